"""The broker's Redis script. Every change to inventory or leases is one of its ops.

Each op (ACQUIRE, RELEASE, ...) is a Lua function that runs atomically, as a script of its
own would. They run through one script, `OPS_SCRIPT`, which takes a list of ops and runs
them one after the other: ops made together leave in one EVALSHA, which costs Redis far
less per op than one EVALSHA each (measured: about 11 us of each call was the call itself
and this file's preamble). Each op is isolated from the others of its list (an error in one
is that op's reply, the next ones still run) and none depends on another.

Every op sees the same three KEYS and first three ARGV, then its own ARGV:

    KEYS[1] <prefix>:nodes    set of registered node names
    KEYS[2] <prefix>:expiry   sorted set: lease id -> expires_unix_ms
    KEYS[3] <prefix>:fence    fencing-token counter (INCR; see "Fencing tokens" below)
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
    <prefix>:waiters                sorted set: waiting Acquire id -> (999 - priority) * 1e12 + arrival
    <prefix>:waiter_expiry          sorted set: waiting Acquire id -> when its record lapses (ms)
    <prefix>:waiter_scope           hash: waiting Acquire id -> its node scope ('' = any node)
    <prefix>:waiter_seq             arrival counter of waiting Acquires (INCR)
    <prefix>:free                   sorted set: "<node> <index:%010d>" -> free MB (best-fit index)
    <prefix>:free:<node>            sorted set: "<index:%010d>" -> free MB (the node's best-fit index)

Invariant kept by ACQUIRE, per GPU: leased_mb + used_outside_mb <= total_mb - reserve_mb.
The fit is always checked against the GPU hash; the two `free` sorted sets only find the best
fit in O(log n) (equal free memory sorts by member: node, then zero-padded index, the order of
`leases.best_fit`). Every script that changes a hash's total/reserve/outside/leased updates
its index entries in step (a grant and REGISTER write them from the hash; a release adds
its MB back), and REGISTER rebuilds a node's entries; a GPU missing from the index is only
not picked by best fit (the caller then plans from a full snapshot).
Waiting Acquires (wait_s > 0) queue in <prefix>:waiters: an Acquire is granted only when no
waiter ahead of it (higher priority, or equal priority and earlier) has an overlapping node
scope, so waiting requests are served in priority then FIFO order by every replica. A waiter
record lapses unless the replica that waits for it refreshes it (a crashed replica's waiters
vanish within seconds).

Fencing tokens never repeat, even when Redis loses its data (FLUSHALL, a restart without
persistence): a missing counter is seeded, by the ACQUIRE that finds it missing, with
max(now_ms * 1000, ARGV[18] + 1), where ARGV[18] is the highest token the calling broker has
seen. A counter seeded so has granted fewer than 1000 tokens per ms since, so a later seed is
above every token it gave unless the seeding broker's clock runs behind by about as long as
the counter lived; the high-water covers the tokens this broker saw itself. A counter that
exists but is behind that high-water (a replica promoted by Sentinel that missed the last
INCRs) is raised to it: the token is max(INCR, ARGV[18] + 1).

A lease is live while expires_ms > now; expired leases count as leased until a script
reaps them (ACQUIRE and REGISTER reap first, RENEW/RELEASE reap the lease they touch,
REAP reaps in batches). Each reaped or changed lease is published on the channel as
JSON {"kind", "ts", "lease": {fields}} inside the same script, so no event is lost
between a change and its announcement.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ACQUIRE",
    "INVENTORY",
    "LEAVE_QUEUE",
    "LIST_LEASES",
    "MAX_OPS_PER_CALL",
    "MAX_PRIORITY",
    "OPS",
    "OPS_SCRIPT",
    "REAP",
    "REAP_BATCH",
    "REGISTER",
    "RELEASE",
    "RENEW",
    "SET_OUTSIDE",
    "LuaOp",
]

# How many expired leases a script reclaims per call (bounds the time one script holds Redis).
REAP_BATCH = 500
# Priorities are 0..MAX_PRIORITY (higher first); see the waiter score in the docstring.
MAX_PRIORITY = 999
# Ops in one OPS_SCRIPT call (bounds the time one call holds Redis; ~50-100 us per op).
MAX_OPS_PER_CALL = 64


@dataclass(frozen=True, slots=True)
class LuaOp:
    """One op of OPS_SCRIPT: `name` (how a call names it), `header` (its KEYS, ARGV and
    replies), `body` (Lua, run as a function of its own ARGV)."""

    name: str
    header: str
    body: str


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
local waiters_key = prefix .. ':waiters'
local waiter_expiry_key = prefix .. ':waiter_expiry'
local waiter_scope_key = prefix .. ':waiter_scope'
local waiter_seq_key = prefix .. ':waiter_seq'
local free_key = prefix .. ':free'
local function node_free_key(node) return prefix .. ':free:' .. node end
local function slot(index) return string.format('%010d', tonumber(index)) end

-- Free MB of a GPU from HMGET total_mb reserve_mb used_outside_mb leased_mb; nil if unknown.
local function free_of(g)
  if not g[1] then return nil end
  return tonumber(g[1]) - tonumber(g[2]) - tonumber(g[3]) - tonumber(g[4] or '0')
end

local function index_free(node, index, free)
  redis.call('ZADD', free_key, free, node .. ' ' .. slot(index))
  redis.call('ZADD', node_free_key(node), free, slot(index))
end

-- `mb` more free on an indexed GPU (XX: a GPU missing from the index stays missing).
local function add_free(node, index, mb)
  redis.call('ZADD', free_key, 'XX', 'INCR', mb, node .. ' ' .. slot(index))
  redis.call('ZADD', node_free_key(node), 'XX', 'INCR', mb, slot(index))
end

local function unindex(node, index)
  redis.call('ZREM', free_key, node .. ' ' .. slot(index))
  redis.call('ZREM', node_free_key(node), slot(index))
end

local function forget_waiter(id)
  redis.call('ZREM', waiters_key, id)
  redis.call('ZREM', waiter_expiry_key, id)
  redis.call('HDEL', waiter_scope_key, id)
end

local function prune_waiters()
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', waiter_expiry_key, '-inf', now)) do forget_waiter(id) end
end

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

-- Free a lease's memory, forget it and announce `kind`. `lease` = its fields as a table
-- when the caller already read them. Returns true if the lease existed.
local function drop_lease(id, kind, lease)
  if not lease then
    local flat = redis.call('HGETALL', lease_key(id))
    if #flat > 0 then lease = to_table(flat) end
  end
  redis.call('ZREM', expiry_key, id)
  if not lease then return false end
  for _, part in ipairs(parse_alloc(lease.alloc)) do
    local key = gpu_key(lease.node, part[1])
    if redis.call('EXISTS', key) == 1 then
      redis.call('HINCRBY', key, 'leased_mb', -part[2])
      add_free(lease.node, part[1], part[2])
    end
  end
  redis.call('DEL', lease_key(id))
  publish(kind, lease)
  return true
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

ACQUIRE = LuaOp(
    "acquire",
    """
-- ACQUIRE: reap expired leases, replay an idempotent request, or grant `alloc` if it still fits.
-- KEYS, ARGV[1..3]: see module docstring.
-- ARGV[4] request key ('' = not idempotent)   ARGV[5] request fingerprint
-- ARGV[6] idempotency record TTL (ms)         ARGV[7] scope node for the state report ('' = all)
-- ARGV[8] new lease id   ARGV[9] holder   ARGV[10] node   ARGV[11] alloc ('' = only report state,
--   '*' = best fit of ARGV[16] MB on one GPU in scope: the least free memory that fits, ties by
--   node then index, as `leases.best_fit`, found in the `free` index)
-- ARGV[12] lease TTL (ms)   ARGV[13] labels (JSON)
-- ARGV[14] priority (0..999)   ARGV[15] waiter record TTL (ms; 0 = do not queue when not granted)
-- ARGV[16] MB wanted (for '*')   ARGV[17] GPU indexes allowed for '*' (",0,2," style; '' = any)
-- ARGV[18] the highest fencing token the caller has seen (seeds a missing counter, raises one behind it; module docstring)
-- returns {'granted', reaped, node, alloc, created_ms, expires_ms, token}
--                                    a new lease (published 'acquired'; the caller knows the rest)
--         {'replayed', reaped, lease fields} the live lease this request already got, its TTL
--                                    counted again from now (published 'renewed')
--         {'gone', reaped, lease id}         this request's lease was released or expired
--         {'mismatch', reaped, lease id}     the request id was used with other parameters
--         {'state', reaped, gpu rows}        no alloc given, or it no longer fits: plan again
--         {'blocked', reaped, ahead}         `ahead` waiters with an overlapping scope come first
-- With ARGV[15] > 0, any answer but a grant leaves the request queued as waiter ARGV[8]
-- (the new lease id), its record refreshed to lapse ARGV[15] ms from now.
""",
    """
local reaped = reap(reap_batch)
local request_key = ARGV[4]
if request_key ~= '' then
  local record = redis.call('HMGET', request_key, 'lease', 'fingerprint')
  if record[1] then
    if record[2] ~= ARGV[5] then return {'mismatch', reaped, record[1]} end
    local flat = redis.call('HGETALL', lease_key(record[1]))
    if #flat == 0 then return {'gone', reaped, record[1]} end
    local lease = to_table(flat)
    if tonumber(lease.expires_ms) <= now then
      drop_lease(record[1], 'expired', lease)
      return {'gone', reaped, record[1]}
    end
    -- A replay is the holder asking again (its first reply was lost): the TTL runs from now, as
    -- a renewal's does, since the holder counts its own deadline from this later request.
    local expires = now + tonumber(ARGV[12])
    if expires > tonumber(lease.expires_ms) then
      lease.expires_ms = int(expires)
      redis.call('HSET', lease_key(record[1]), 'expires_ms', lease.expires_ms)
      redis.call('ZADD', expiry_key, expires, record[1])
      publish('renewed', lease)
      for i = 1, #flat, 2 do
        if flat[i] == 'expires_ms' then flat[i + 1] = lease.expires_ms end
      end
    end
    return {'replayed', reaped, flat}
  end
end
local id = ARGV[8]
local scope = ARGV[7]
local queue_ttl = tonumber(ARGV[15])
local my_score = nil
local ahead = 0
-- An empty queue has no lapsed records either (a waiter's entries come and go together).
if redis.call('ZCARD', waiters_key) > 0 then
  prune_waiters()
  my_score = redis.call('ZSCORE', waiters_key, id)
  local bound = my_score and ('(' .. my_score)
    or string.format('%d', (999 - tonumber(ARGV[14])) * 1e12 + 1e12 - 1)
  for _, other in ipairs(redis.call('ZRANGEBYSCORE', waiters_key, '-inf', bound)) do
    local other_scope = redis.call('HGET', waiter_scope_key, other) or ''
    if other ~= id and (scope == '' or other_scope == '' or other_scope == scope) then ahead = ahead + 1 end
  end
end
local function enqueue()
  if queue_ttl <= 0 then return end
  if not my_score then
    my_score = string.format('%d', (999 - tonumber(ARGV[14])) * 1e12 + redis.call('INCR', waiter_seq_key))
    redis.call('ZADD', waiters_key, my_score, id)
    redis.call('HSET', waiter_scope_key, id, scope)
  end
  redis.call('ZADD', waiter_expiry_key, now + queue_ttl, id)
end
if ahead > 0 then
  enqueue()
  return {'blocked', reaped, ahead}
end
local alloc_text = ARGV[11]
if alloc_text == '' then
  enqueue()
  return {'state', reaped, read_gpus(scope)}
end

local node = ARGV[10]
local need = {}
if alloc_text == '*' then
  local want = tonumber(ARGV[16])
  local allowed = ARGV[17]
  local pick = nil
  if scope == '' then
    local limit = allowed == '' and 1 or -1
    for _, member in ipairs(redis.call('ZRANGEBYSCORE', free_key, want, '+inf', 'LIMIT', 0, limit)) do
      local n, index = string.match(member, '^(.*) (%d+)$')
      if allowed == '' or string.find(allowed, ',' .. tonumber(index) .. ',', 1, true) then
        pick = {n, tonumber(index)}
        break
      end
    end
  else
    local limit = allowed == '' and 1 or -1
    for _, member in ipairs(redis.call('ZRANGEBYSCORE', node_free_key(scope), want, '+inf', 'LIMIT', 0, limit)) do
      if allowed == '' or string.find(allowed, ',' .. tonumber(member) .. ',', 1, true) then
        pick = {scope, tonumber(member)}
        break
      end
    end
  end
  if pick == nil then
    enqueue()
    return {'state', reaped, read_gpus(scope)}
  end
  node = pick[1]
  need[int(pick[2])] = want
  alloc_text = int(pick[2]) .. '=' .. int(want)
else
  for _, part in ipairs(parse_alloc(alloc_text)) do need[part[1]] = (need[part[1]] or 0) + part[2] end
end
local free_after = {}
for index, mb in pairs(need) do
  local free = free_of(redis.call('HMGET', gpu_key(node, index),
    'total_mb', 'reserve_mb', 'used_outside_mb', 'leased_mb')) or -1
  if mb > free then
    enqueue()
    return {'state', reaped, read_gpus(scope)}
  end
  free_after[index] = free - mb
end
if my_score then forget_waiter(id) end

for index, mb in pairs(need) do
  redis.call('HINCRBY', gpu_key(node, index), 'leased_mb', mb)
  index_free(node, index, free_after[index])
end
if redis.call('EXISTS', fence_key) == 0 then
  redis.call('SET', fence_key, int(math.max(now * 1000, tonumber(ARGV[18]) + 1) - 1))
end
local token = redis.call('INCR', fence_key)
if token <= tonumber(ARGV[18]) then  -- a counter behind a token already granted (failover)
  token = tonumber(ARGV[18]) + 1
  redis.call('SET', fence_key, int(token))
end
token = int(token)
local created = int(now)
local expires = int(now + tonumber(ARGV[12]))
redis.call('HSET', lease_key(id), 'id', id, 'holder', ARGV[9], 'node', node, 'alloc', alloc_text,
  'labels', ARGV[13], 'created_ms', created, 'expires_ms', expires, 'token', token)
redis.call('ZADD', expiry_key, expires, id)
if request_key ~= '' then
  redis.call('HSET', request_key, 'lease', id, 'fingerprint', ARGV[5])
  redis.call('PEXPIRE', request_key, ARGV[6])
end
publish('acquired', {id = id, holder = ARGV[9], node = node, alloc = alloc_text, labels = ARGV[13],
  created_ms = created, expires_ms = expires, token = token})
return {'granted', reaped, node, alloc_text, created, expires, token}
""",
)

RENEW = LuaOp(
    "renew",
    """
-- RENEW: extend a live lease whose fencing token matches.
-- KEYS, ARGV[1..3]: see module docstring.
-- ARGV[4] lease id   ARGV[5] fencing token   ARGV[6] new TTL from now (ms)
-- returns {'renewed', lease fields} (published 'renewed')
--         {'expired', expires_ms}   it had expired: reaped now (published 'expired')
--         {'stale', current token}  the token does not match the lease's
--         {'gone'}                  no such lease (released, reaped, or never granted)
""",
    """
local id = ARGV[4]
local flat = redis.call('HGETALL', lease_key(id))
if #flat == 0 then return {'gone'} end
local lease = to_table(flat)
if tonumber(lease.expires_ms) <= now then
  drop_lease(id, 'expired', lease)
  return {'expired', lease.expires_ms}
end
if lease.token ~= ARGV[5] then return {'stale', lease.token} end
local expires = now + tonumber(ARGV[6])
lease.expires_ms = int(expires)
redis.call('HSET', lease_key(id), 'expires_ms', lease.expires_ms)
redis.call('ZADD', expiry_key, expires, id)
publish('renewed', lease)
for i = 1, #flat, 2 do
  if flat[i] == 'expires_ms' then flat[i + 1] = lease.expires_ms end
end
return {'renewed', flat}
""",
)

RELEASE = LuaOp(
    "release",
    """
-- RELEASE: free a live lease whose fencing token matches.
-- KEYS, ARGV[1..3]: see module docstring.
-- ARGV[4] lease id   ARGV[5] fencing token
-- returns {'released'}              (published 'released')
--         {'expired'}               it had expired: reaped now (published 'expired')
--         {'stale', current token}  the token does not match: nothing changed
--         {'gone'}                  no such lease
""",
    """
local id = ARGV[4]
local flat = redis.call('HGETALL', lease_key(id))
if #flat == 0 then return {'gone'} end
local lease = to_table(flat)
if tonumber(lease.expires_ms) <= now then
  drop_lease(id, 'expired', lease)
  return {'expired'}
end
if lease.token ~= ARGV[5] then return {'stale', lease.token} end
drop_lease(id, 'released', lease)
return {'released'}
""",
)

REAP = LuaOp(
    "reap",
    """
-- REAP: free up to ARGV[4] leases whose expires_ms <= now. Safe from many replicas at once:
-- a lease is reaped by exactly one call.
-- KEYS, ARGV[1..3]: see module docstring.   ARGV[4] limit
-- returns the number of leases reaped (each published 'expired')
""",
    """
return reap(tonumber(ARGV[4]))
""",
)

REGISTER = LuaOp(
    "register",
    """
-- REGISTER: set a node's GPUs (total, reserve, used outside leases, name, uuid), keeping
-- each GPU's leased_mb, so live leases survive re-registration; rebuilds their `free` index.
-- KEYS, ARGV[1..3]: see module docstring.
-- ARGV[4] node   ARGV[5] JSON list of {index, total_mb, reserve_mb, used_outside_mb, name, uuid}
-- returns {'ok', gpu rows of the node}
--         {'busy', index, leased_mb}  the list drops a GPU that still holds leases: nothing changed
""",
    """
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
    unindex(node, index)
  end
end
for _, g in ipairs(gpus) do
  local key = gpu_key(node, int(g.index))
  redis.call('HSET', key, 'total_mb', int(g.total_mb), 'reserve_mb', int(g.reserve_mb),
    'used_outside_mb', int(g.used_outside_mb), 'name', g.name, 'uuid', g.uuid)
  redis.call('HSETNX', key, 'leased_mb', '0')
  redis.call('SADD', node_key(node), int(g.index))
  index_free(node, g.index, g.total_mb - g.reserve_mb - g.used_outside_mb
    - tonumber(redis.call('HGET', key, 'leased_mb')))
end
if #gpus > 0 then redis.call('SADD', nodes_key, node) else redis.call('SREM', nodes_key, node) end
return {'ok', read_gpus(node)}
""",
)

INVENTORY = LuaOp(
    "inventory",
    """
-- INVENTORY (read only): one consistent snapshot of the GPUs of a node or of all nodes.
-- KEYS, ARGV[1..3]: see module docstring.   ARGV[4] node ('' = all)
-- returns gpu rows {node, index, total, reserve, used_outside, leased, name, uuid}
""",
    """
return read_gpus(ARGV[4])
""",
)

LIST_LEASES = LuaOp(
    "list_leases",
    """
-- LIST_LEASES (read only): live leases (expires_ms > now), optionally of one node / holder.
-- KEYS, ARGV[1..3]: see module docstring.   ARGV[4] node ('' = all)   ARGV[5] holder ('' = all)
-- returns a list of lease fields (flat), soonest expiry first
""",
    """
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
""",
)

LEAVE_QUEUE = LuaOp(
    "leave_queue",
    """
-- LEAVE_QUEUE: forget a waiting Acquire (it was granted elsewhere, gave up, or was cancelled).
-- KEYS, ARGV[1..3]: see module docstring.   ARGV[4] waiter id
-- returns the number of waiters left after pruning lapsed records
""",
    """
forget_waiter(ARGV[4])
prune_waiters()
return redis.call('ZCARD', waiters_key)
""",
)

SET_OUTSIDE = LuaOp(
    "set_outside",
    """
-- SET_OUTSIDE: record GPU memory in use outside any live lease (sampled from NVML).
-- KEYS, ARGV[1..3]: see module docstring.   ARGV[4] node   ARGV[5] "index=mb,index=mb"
-- Unknown GPUs are skipped. Leases are not touched: when outside use grows past what is
-- free, the GPU grants nothing until it shrinks again.
-- returns the number of GPUs updated
""",
    """
local updated = 0
for _, part in ipairs(parse_alloc(ARGV[5])) do
  local key = gpu_key(ARGV[4], part[1])
  local g = redis.call('HMGET', key, 'total_mb', 'reserve_mb', 'used_outside_mb', 'leased_mb')
  if g[1] then
    redis.call('HSET', key, 'used_outside_mb', int(part[2]))
    g[3] = part[2]
    index_free(ARGV[4], part[1], free_of(g))
    updated = updated + 1
  end
end
return updated
""",
)


OPS = (ACQUIRE, RENEW, RELEASE, REAP, REGISTER, INVENTORY, LIST_LEASES, LEAVE_QUEUE, SET_OUTSIDE)


def _ops_script(ops: tuple[LuaOp, ...]) -> str:
    functions = "".join(
        f"{op.header}local function op_{op.name}(ARGV)\nnow = tonumber(ARGV[2])\n{op.body}end\n" for op in ops
    )
    table = ", ".join(f"{op.name} = op_{op.name}" for op in ops)
    return (
        """
-- OPS: run a list of ops, each atomic on its own (the list as a whole runs atomically too).
-- KEYS, ARGV[1..3]: see module docstring (ARGV[2]: the first op's now_ms).
-- ARGV[4..]: per op: its name, its now_ms, n, then its n own ARGV (ARGV[4..3+n] of the op).
-- returns one reply per op, in order: what the op returns, or an error reply when the op
-- raised (its name unknown, a failed redis.call) -- a Lua error does not undo the writes the
-- op made before it, exactly as for a script of its own.
"""
        + _COMMON
        + functions
        + f"local ops = {{{table}}}\n"
        + """
local replies = {}
local i = 4
while i <= #ARGV do
  local op, n = ops[ARGV[i]], tonumber(ARGV[i + 2])
  local args = {prefix, ARGV[i + 1], channel}
  for k = 1, n do args[3 + k] = ARGV[i + 2 + k] end
  local ok, reply = pcall(op or error, op and args or ('unknown op ' .. ARGV[i]))
  if not ok then
    if type(reply) == 'table' and reply.err then reply = reply.err end
    reply = {err = tostring(reply)}
  end
  replies[#replies + 1] = reply
  i = i + 3 + n
end
return replies
"""
    )


OPS_SCRIPT = _ops_script(OPS)
