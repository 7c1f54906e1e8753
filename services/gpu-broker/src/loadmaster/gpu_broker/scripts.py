"""The broker's Redis scripts. Every change to inventory or leases is one of these.

All scripts take the same three KEYS and first three ARGV, then their own ARGV:

    KEYS[1] <prefix>:nodes    set of registered node names
    KEYS[2] <prefix>:expiry   sorted set: lease id -> expires_unix_ms
    KEYS[3] <prefix>:fence    fencing-token counter (INCR, never reset)
    ARGV[1] prefix            key prefix (`settings.gpu_broker.key_prefix`)
    ARGV[2] now_ms            the broker's clock, UNIX ms (injected, so tests drive time)
    ARGV[3] channel           pub/sub channel for lease events (<prefix>:events)

Keys derived from the prefix inside the scripts (not declared in KEYS, so a Redis
Cluster needs a hash-tagged prefix such as `{loadmaster:gpu}` to keep them in one slot):

    <prefix>:node:<node>            set of the node's GPU indexes
    <prefix>:gpu:<node>:<index>     hash total_mb reserve_mb used_outside_mb leased_mb name uuid
    <prefix>:lease:<id>             hash id holder node alloc labels created_ms expires_ms token
                                    (alloc = "index=mb,index=mb"; labels = JSON object)
    <prefix>:request:<...>          hash lease fingerprint, with a TTL (idempotency record)

Invariant kept by ACQUIRE, per GPU: leased_mb + used_outside_mb <= total_mb - reserve_mb.
A lease is live while expires_ms > now; expired leases count as leased until a script
reaps them (ACQUIRE and REGISTER reap first, RENEW/RELEASE reap the lease they touch,
REAP reaps in batches). Each reaped or changed lease is published on the channel as
JSON {"kind", "ts", "lease": {fields}} inside the same script, so no event is lost
between a change and its announcement.
"""

from __future__ import annotations

__all__ = [
    "ACQUIRE_SCRIPT",
    "INVENTORY_SCRIPT",
    "LIST_LEASES_SCRIPT",
    "REAP_BATCH",
    "REAP_SCRIPT",
    "REGISTER_SCRIPT",
    "RELEASE_SCRIPT",
    "RENEW_SCRIPT",
]

# How many expired leases a script reclaims per call (bounds the time one script holds Redis).
REAP_BATCH = 500

_COMMON = (
    f"\nlocal reap_batch = {REAP_BATCH}"
    + """
local prefix = ARGV[1]
local now = tonumber(ARGV[2])
local channel = ARGV[3]
local nodes_key = KEYS[1]
local expiry_key = KEYS[2]
local fence_key = KEYS[3]

local function int(x) return string.format('%d', x) end
local function node_key(node) return prefix .. ':node:' .. node end
local function gpu_key(node, index) return prefix .. ':gpu:' .. node .. ':' .. index end
local function lease_key(id) return prefix .. ':lease:' .. id end

local function parse_alloc(text)
  local alloc = {}
  for index, mb in string.gmatch(text, '(%d+)=(%d+)') do
    alloc[#alloc + 1] = {index, tonumber(mb)}
  end
  return alloc
end

local function to_table(flat)
  local t = {}
  for i = 1, #flat, 2 do t[flat[i]] = flat[i + 1] end
  return t
end

local function publish(kind, lease)
  redis.call('PUBLISH', channel, cjson.encode({kind = kind, ts = int(now), lease = lease}))
end

-- Free a lease's memory, forget it and announce `kind`. Returns its fields (flat), or {}.
local function drop_lease(id, kind)
  local flat = redis.call('HGETALL', lease_key(id))
  redis.call('ZREM', expiry_key, id)
  if #flat == 0 then return flat end
  local lease = to_table(flat)
  for _, part in ipairs(parse_alloc(lease.alloc)) do
    local key = gpu_key(lease.node, part[1])
    if redis.call('EXISTS', key) == 1 then redis.call('HINCRBY', key, 'leased_mb', -part[2]) end
  end
  redis.call('DEL', lease_key(id))
  publish(kind, lease)
  return flat
end

local function reap(limit)
  local ids = redis.call('ZRANGEBYSCORE', expiry_key, '-inf', now, 'LIMIT', 0, limit)
  for _, id in ipairs(ids) do drop_lease(id, 'expired') end
  return #ids
end

-- Rows {node, index, total, reserve, used_outside, leased, name, uuid} of one node ('' = all).
local function read_gpus(scope)
  local rows = {}
  local nodes = {scope}
  if scope == '' then nodes = redis.call('SMEMBERS', nodes_key) end
  for _, node in ipairs(nodes) do
    for _, index in ipairs(redis.call('SMEMBERS', node_key(node))) do
      local g = redis.call('HMGET', gpu_key(node, index),
        'total_mb', 'reserve_mb', 'used_outside_mb', 'leased_mb', 'name', 'uuid')
      rows[#rows + 1] = {node, index, g[1] or '0', g[2] or '0', g[3] or '0', g[4] or '0',
        g[5] or '', g[6] or ''}
    end
  end
  return rows
end
"""
)

ACQUIRE_SCRIPT = (
    """
-- ACQUIRE: reap expired leases, replay an idempotent request, or grant `alloc` if it still fits.
-- KEYS, ARGV[1..3]: see module docstring.
-- ARGV[4] request key ('' = not idempotent)   ARGV[5] request fingerprint
-- ARGV[6] idempotency record TTL (ms)         ARGV[7] scope node for the state report ('' = all)
-- ARGV[8] new lease id   ARGV[9] holder   ARGV[10] node   ARGV[11] alloc ('' = only report state)
-- ARGV[12] lease TTL (ms)   ARGV[13] labels (JSON)
-- returns {'granted', reaped, lease fields}  a new lease (published 'acquired')
--         {'replayed', reaped, lease fields} the live lease this request already got
--         {'gone', reaped, lease id}         this request's lease was released or expired
--         {'mismatch', reaped, lease id}     the request id was used with other parameters
--         {'state', reaped, gpu rows}        no alloc given, or it no longer fits: plan again
"""
    + _COMMON
    + """
local reaped = reap(reap_batch)
local request_key = ARGV[4]
if request_key ~= '' then
  local record = redis.call('HMGET', request_key, 'lease', 'fingerprint')
  if record[1] then
    if record[2] ~= ARGV[5] then return {'mismatch', reaped, record[1]} end
    local flat = redis.call('HGETALL', lease_key(record[1]))
    if #flat == 0 then return {'gone', reaped, record[1]} end
    return {'replayed', reaped, flat}
  end
end
local alloc_text = ARGV[11]
if alloc_text == '' then return {'state', reaped, read_gpus(ARGV[7])} end

local node = ARGV[10]
local alloc = parse_alloc(alloc_text)
local need = {}
for _, part in ipairs(alloc) do need[part[1]] = (need[part[1]] or 0) + part[2] end
for index, mb in pairs(need) do
  local g = redis.call('HMGET', gpu_key(node, index), 'total_mb', 'reserve_mb', 'used_outside_mb', 'leased_mb')
  if not g[1] then return {'state', reaped, read_gpus(ARGV[7])} end
  local free = tonumber(g[1]) - tonumber(g[2]) - tonumber(g[3]) - tonumber(g[4] or '0')
  if mb > free then return {'state', reaped, read_gpus(ARGV[7])} end
end

for index, mb in pairs(need) do redis.call('HINCRBY', gpu_key(node, index), 'leased_mb', mb) end
local token = redis.call('INCR', fence_key)
local id = ARGV[8]
local expires = now + tonumber(ARGV[12])
local fields = {'id', id, 'holder', ARGV[9], 'node', node, 'alloc', alloc_text, 'labels', ARGV[13],
  'created_ms', int(now), 'expires_ms', int(expires), 'token', int(token)}
redis.call('HSET', lease_key(id), unpack(fields))
redis.call('ZADD', expiry_key, expires, id)
if request_key ~= '' then
  redis.call('HSET', request_key, 'lease', id, 'fingerprint', ARGV[5])
  redis.call('PEXPIRE', request_key, ARGV[6])
end
publish('acquired', to_table(fields))
return {'granted', reaped, fields}
"""
)

RENEW_SCRIPT = (
    """
-- RENEW: extend a live lease whose fencing token matches.
-- KEYS, ARGV[1..3]: see module docstring.
-- ARGV[4] lease id   ARGV[5] fencing token   ARGV[6] new TTL from now (ms)
-- returns {'renewed', lease fields} (published 'renewed')
--         {'expired', expires_ms}   it had expired: reaped now (published 'expired')
--         {'stale', current token}  the token does not match the lease's
--         {'gone'}                  no such lease (released, reaped, or never granted)
"""
    + _COMMON
    + """
local id = ARGV[4]
local flat = redis.call('HGETALL', lease_key(id))
if #flat == 0 then return {'gone'} end
local lease = to_table(flat)
if tonumber(lease.expires_ms) <= now then
  drop_lease(id, 'expired')
  return {'expired', lease.expires_ms}
end
if lease.token ~= ARGV[5] then return {'stale', lease.token} end
local expires = now + tonumber(ARGV[6])
lease.expires_ms = int(expires)
redis.call('HSET', lease_key(id), 'expires_ms', lease.expires_ms)
redis.call('ZADD', expiry_key, expires, id)
publish('renewed', lease)
return {'renewed', redis.call('HGETALL', lease_key(id))}
"""
)

RELEASE_SCRIPT = (
    """
-- RELEASE: free a live lease whose fencing token matches.
-- KEYS, ARGV[1..3]: see module docstring.
-- ARGV[4] lease id   ARGV[5] fencing token
-- returns {'released', lease fields} (published 'released')
--         {'expired'}               it had expired: reaped now (published 'expired')
--         {'stale', current token}  the token does not match: nothing changed
--         {'gone'}                  no such lease
"""
    + _COMMON
    + """
local id = ARGV[4]
local flat = redis.call('HGETALL', lease_key(id))
if #flat == 0 then return {'gone'} end
local lease = to_table(flat)
if tonumber(lease.expires_ms) <= now then
  drop_lease(id, 'expired')
  return {'expired'}
end
if lease.token ~= ARGV[5] then return {'stale', lease.token} end
return {'released', drop_lease(id, 'released')}
"""
)

REAP_SCRIPT = (
    """
-- REAP: free up to ARGV[4] leases whose expires_ms <= now. Safe from many replicas at once:
-- a lease is reaped by exactly one call.
-- KEYS, ARGV[1..3]: see module docstring.   ARGV[4] limit
-- returns the number of leases reaped (each published 'expired')
"""
    + _COMMON
    + """
return reap(tonumber(ARGV[4]))
"""
)

REGISTER_SCRIPT = (
    """
-- REGISTER: set a node's GPUs (total, reserve, used outside leases, name, uuid), keeping
-- each GPU's leased_mb, so live leases survive re-registration.
-- KEYS, ARGV[1..3]: see module docstring.
-- ARGV[4] node   ARGV[5] JSON list of {index, total_mb, reserve_mb, used_outside_mb, name, uuid}
-- returns {'ok', gpu rows of the node}
--         {'busy', index, leased_mb}  the list drops a GPU that still holds leases: nothing changed
"""
    + _COMMON
    + """
reap(reap_batch)
local node = ARGV[4]
local gpus = cjson.decode(ARGV[5])
local keep = {}
for _, g in ipairs(gpus) do keep[int(g.index)] = true end
local existing = redis.call('SMEMBERS', node_key(node))
for _, index in ipairs(existing) do
  if not keep[index] then
    local leased = tonumber(redis.call('HGET', gpu_key(node, index), 'leased_mb') or '0')
    if leased > 0 then return {'busy', index, leased} end
  end
end
for _, index in ipairs(existing) do
  if not keep[index] then
    redis.call('DEL', gpu_key(node, index))
    redis.call('SREM', node_key(node), index)
  end
end
for _, g in ipairs(gpus) do
  local key = gpu_key(node, int(g.index))
  redis.call('HSET', key, 'total_mb', int(g.total_mb), 'reserve_mb', int(g.reserve_mb),
    'used_outside_mb', int(g.used_outside_mb), 'name', g.name, 'uuid', g.uuid)
  redis.call('HSETNX', key, 'leased_mb', '0')
  redis.call('SADD', node_key(node), int(g.index))
end
if #gpus > 0 then redis.call('SADD', nodes_key, node) else redis.call('SREM', nodes_key, node) end
return {'ok', read_gpus(node)}
"""
)

INVENTORY_SCRIPT = (
    """
-- INVENTORY (read only): one consistent snapshot of the GPUs of a node or of all nodes.
-- KEYS, ARGV[1..3]: see module docstring.   ARGV[4] node ('' = all)
-- returns gpu rows {node, index, total, reserve, used_outside, leased, name, uuid}
"""
    + _COMMON
    + """
return read_gpus(ARGV[4])
"""
)

LIST_LEASES_SCRIPT = (
    """
-- LIST_LEASES (read only): live leases (expires_ms > now), optionally of one node / holder.
-- KEYS, ARGV[1..3]: see module docstring.   ARGV[4] node ('' = all)   ARGV[5] holder ('' = all)
-- returns a list of lease fields (flat), soonest expiry first
"""
    + _COMMON
    + """
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', expiry_key, '(' .. int(now), '+inf')) do
  local flat = redis.call('HGETALL', lease_key(id))
  if #flat > 0 then
    local lease = to_table(flat)
    if (ARGV[4] == '' or lease.node == ARGV[4]) and (ARGV[5] == '' or lease.holder == ARGV[5]) then
      out[#out + 1] = flat
    end
  end
end
return out
"""
)
