"""`RedisLeaseStore`: every Redis call the broker makes, and the storage encoding.

Each method is one script op (see `scripts.py`) plus the translation of its reply into
domain values; ops are batched and pipelined on one connection (`_coalesce.py`). Connection
trouble becomes `UnavailableError` within about `timeout_s`; calls are never retried
automatically (a retried acquire could grant twice), so callers retry with the same
client_request_id instead. The exception is a NOSCRIPT reply: that script did not run.

`url` may name Redis behind Sentinel (`redis+sentinel://`, parsed by
`loadmaster.common.redis_url`): every connection then goes to the master the Sentinels
name, and after a failover to the new one. With `replica_ack_timeout_ms` > 0 the ops that
change state are answered only once a replica holds their writes (`WAIT`), so an answered
grant survives a failover (docs/gpu-broker-internals.md, "Redis high availability").
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from loadmaster.common.errors import FailedPreconditionError, UnavailableError
from loadmaster.common.redis_url import is_sentinel_url, parse_sentinel_url
from loadmaster.gpu_broker import scripts
from loadmaster.gpu_broker._coalesce import (
    ReplicaAckError,
    ScriptCoalescer,
    new_reader,
    open_stream,
    pack_command,
    reply_value,
)
from loadmaster.gpu_broker.leases import (
    AcquireRequest,
    GpuState,
    Lease,
    LeaseEvent,
    LeaseEventKind,
    Placement,
)

__all__ = [
    "ACKED_OPS",
    "DEFAULT_REPLICA_ACK_TIMEOUT_MS",
    "IDEMPOTENCY_TTL_MS",
    "AcquireOutcome",
    "Blocked",
    "ChangeStatus",
    "EventSubscription",
    "Granted",
    "LeaseChange",
    "RedisLeaseStore",
    "RequestReused",
    "Snapshot",
    "decode_alloc",
    "decode_event",
    "default_replica_ack_timeout_ms",
    "encode_alloc",
    "event_from_message",
    "lease_from_fields",
]

log = logging.getLogger(__name__)

# How long a client_request_id is remembered (at least; longer for long leases).
IDEMPOTENCY_TTL_MS = 10 * 60 * 1000
HEALTH_CHECK_S = 30
_REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ReadOnlyError, OSError)
# The ops whose writes a replica must hold before they are answered (when acks are on): those
# that grant, extend, return or declare memory. A lost REAP, LEAVE_QUEUE or SET_OUTSIDE is
# done again by the next reaper step or request.
ACKED_OPS = frozenset(op.name for op in (scripts.ACQUIRE, scripts.RENEW, scripts.RELEASE, scripts.REGISTER))
# Replica acknowledgement wait when the URL is a Sentinel URL and the setting is left unset.
DEFAULT_REPLICA_ACK_TIMEOUT_MS = 200


def default_replica_ack_timeout_ms(url: str) -> int:
    """`DEFAULT_REPLICA_ACK_TIMEOUT_MS` for Redis behind Sentinel (it has replicas to fail
    over to), else 0 (off)."""
    return DEFAULT_REPLICA_ACK_TIMEOUT_MS if is_sentinel_url(url) else 0


@dataclass(frozen=True, slots=True)
class Granted:
    lease: Lease
    replayed: bool  # the request id had already been granted this (live) lease
    reaped: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The plan was missing or no longer fits: the GPUs in scope, as they are now."""

    gpus: list[GpuState]
    reaped: int


@dataclass(frozen=True, slots=True)
class RequestReused:
    """The request id already produced `lease_id`, now gone (`mismatch` = other parameters)."""

    lease_id: str
    mismatch: bool
    reaped: int


@dataclass(frozen=True, slots=True)
class Blocked:
    """`ahead` waiting requests with an overlapping scope come first (priority, then FIFO)."""

    ahead: int
    reaped: int


AcquireOutcome = Granted | Snapshot | RequestReused | Blocked


class ChangeStatus(StrEnum):
    DONE = "done"
    EXPIRED = "expired"
    STALE = "stale"
    GONE = "gone"


@dataclass(frozen=True, slots=True)
class LeaseChange:
    """Result of renew/release. `lease`: the renewed lease (RENEW only). `detail`: the expiry
    (EXPIRED) or current token (STALE)."""

    status: ChangeStatus
    lease: Lease | None = None
    detail: str = ""


def encode_alloc(mb_per_gpu: Mapping[int, int]) -> str:
    return ",".join(f"{index}={mb}" for index, mb in sorted(mb_per_gpu.items()))


def decode_alloc(text: str) -> dict[int, int]:
    if not text:
        return {}
    pairs = (part.split("=", 1) for part in text.split(","))
    return {int(index): int(mb) for index, mb in pairs}


def lease_from_fields(fields: Mapping[str, str]) -> Lease:
    return Lease(
        lease_id=fields["id"],
        holder=fields["holder"],
        node=fields["node"],
        mb_per_gpu=decode_alloc(fields["alloc"]),
        labels=json.loads(fields.get("labels") or "{}"),
        created_unix_ms=int(fields["created_ms"]),
        expires_unix_ms=int(fields["expires_ms"]),
        fencing_token=int(fields["token"]),
    )


def _lease(flat: Sequence[str]) -> Lease:
    return lease_from_fields(dict(zip(flat[::2], flat[1::2], strict=True)))


def _gpu(row: Sequence[str]) -> GpuState:
    node, index, total, reserve, outside, leased, name, uuid = row
    return GpuState(
        node=node,
        index=int(index),
        total_mb=int(total),
        reserve_mb=int(reserve),
        used_outside_mb=int(outside),
        leased_mb=int(leased),
        name=name,
        uuid=uuid,
    )


def _gpus(rows: Sequence[Sequence[str]]) -> list[GpuState]:
    return sorted((_gpu(row) for row in rows), key=lambda g: (g.node, g.index))


def event_from_message(data: str) -> LeaseEvent:
    """Decode one message of the events channel (raises ValueError/KeyError when malformed)."""
    message = json.loads(data)
    return LeaseEvent(
        kind=LeaseEventKind(message["kind"]),
        lease=lease_from_fields(message["lease"]),
        timestamp_unix_ms=int(message["ts"]),
    )


def decode_event(data: str) -> LeaseEvent | None:
    """`event_from_message`, or None (logged) for a malformed message."""
    try:
        return event_from_message(data)
    except (ValueError, KeyError, TypeError):
        log.warning("ignoring a malformed lease event: %.200r", data)
        return None


class EventSubscription:
    """One connection subscribed to the events channel, read in bulk: each read of the socket
    parses every message it holds (redis-py's pub/sub layer read and checked one message per
    call, a large part of a busy broker's CPU). A connection quiet for a whole read timeout
    is sent a PING; quiet for another, it counts as lost."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._parser = new_reader()
        self._messages: collections.deque[str] = collections.deque()
        self._replies: collections.deque[Any] = collections.deque()  # anything but a message
        self._pinged = False

    @classmethod
    async def open(
        cls, pool: aioredis.ConnectionPool, channel: str, *, timeout_s: float
    ) -> EventSubscription:
        """Subscribe on a new connection; returns once Redis confirmed the subscription."""
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await open_stream(pool)
        except (*_REDIS_DOWN, TimeoutError) as error:
            raise UnavailableError(f"Redis unreachable: {error or 'no connection in time'}") from error
        subscription = cls(reader, writer)
        try:
            writer.write(pack_command("SUBSCRIBE", channel))
            async with asyncio.timeout(timeout_s):
                while not subscription._replies:
                    await subscription._read()
            confirmation = reply_value(subscription._replies.popleft())
            if not isinstance(confirmation, list) or confirmation[:2] != ["subscribe", channel]:
                raise UnavailableError(
                    f"Redis did not confirm the subscription to {channel}: {confirmation!r}"
                )
        except TimeoutError as error:
            await subscription.close()
            raise UnavailableError(f"Redis did not confirm the subscription to {channel}") from error
        except BaseException:
            await subscription.close()
            raise
        return subscription

    async def next(self, timeout_s: float) -> LeaseEvent | None:
        """The next event, or None after `timeout_s` without one (or for a malformed message)."""
        data = await self.next_message(timeout_s)
        return None if data is None else decode_event(data)

    async def next_message(self, timeout_s: float) -> str | None:
        """The next event still encoded (see `decode_event`), or None after `timeout_s`
        without one: a listener with nobody to tell skips the decoding."""
        if not self._messages:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._read()
            except TimeoutError:
                if self._pinged:
                    raise UnavailableError("lost the Redis event stream: no answer to a PING") from None
                self._pinged = True
                self._writer.write(pack_command("PING"))
            self._replies.clear()  # PONGs
            if not self._messages:
                return None
        return self._messages.popleft()

    async def _read(self) -> None:
        try:
            data = await self._reader.read(1 << 16)
        except OSError as error:
            raise UnavailableError(f"lost the Redis event stream: {error}") from error
        if not data:
            raise UnavailableError("lost the Redis event stream: the connection was closed")
        self._pinged = False  # any data shows the connection lives
        self._parser.feed(data)
        try:
            while (reply := self._parser.gets()) is not False:
                if isinstance(reply, list) and len(reply) == 3 and reply[0] == "message":
                    self._messages.append(reply[2])
                else:
                    self._replies.append(reply)
        except hiredis.ProtocolError as error:
            raise UnavailableError(f"lost the Redis event stream: {error}") from error

    async def close(self) -> None:
        try:
            self._writer.close()
            await self._writer.wait_closed()
        except Exception:
            log.debug("closing the event subscription failed", exc_info=True)


class RedisLeaseStore:
    def __init__(
        self,
        client: aioredis.Redis,
        *,
        key_prefix: str,
        timeout_s: float,
        replica_ack_timeout_ms: int = 0,
        sentinel: Sentinel | None = None,
    ) -> None:
        self._redis = client
        self._sentinel = sentinel
        self._timeout_s = timeout_s
        self._ack_ms = replica_ack_timeout_ms
        self._prefix = key_prefix
        self.channel = f"{key_prefix}:events"
        self._keys = [f"{key_prefix}:nodes", f"{key_prefix}:expiry", f"{key_prefix}:fence"]
        # The highest fencing token this store has seen: seeds the counter should Redis lose it.
        self._max_token = 0
        self._coalescer = ScriptCoalescer(
            client.connection_pool,
            script=scripts.OPS_SCRIPT,
            keys=self._keys,
            prefix=key_prefix,
            channel=self.channel,
            timeout_s=timeout_s,
            max_ops_per_call=scripts.MAX_OPS_PER_CALL,
            replica_ack_timeout_ms=replica_ack_timeout_ms,
            acked_ops=ACKED_OPS,
        )

    @classmethod
    def connect(
        cls,
        url: str,
        *,
        key_prefix: str,
        timeout_s: float = 1.0,
        max_connections: int = 64,
        replica_ack_timeout_ms: int = 0,
    ) -> RedisLeaseStore:
        """A store on `url` (`redis://`, `rediss://`, `unix://` or `redis+sentinel://`).
        Opens no connection until the first call. Script ops are batched and pipelined on
        one connection of their own (`_coalesce.py`); each fails after `timeout_s` (plus
        the replica acknowledgement wait) without a reply. The pool serves the few other
        commands."""
        options: dict[str, Any] = {
            "decode_responses": True,
            "socket_timeout": None,  # not redis-py's default 5 s: our own deadline covers each call
            "socket_connect_timeout": timeout_s,
            "max_connections": max_connections,
            "retry": Retry(NoBackoff(), 0),
            # A PING before using a pooled connection quiet this long (the few commands that
            # are not script ops; the ops and the event subscription have connections of
            # their own, which the pool only opens). At 5 s nearly every call of an idle
            # broker paid a PING round trip first.
            "health_check_interval": HEALTH_CHECK_S,
        }
        sentinel: Sentinel | None = None
        if is_sentinel_url(url):
            target = parse_sentinel_url(url)
            sentinel = Sentinel(
                list(target.sentinels),
                sentinel_kwargs={
                    "socket_timeout": timeout_s,
                    "socket_connect_timeout": timeout_s,
                    "retry": Retry(NoBackoff(), 0),
                    "password": target.sentinel_password,
                },
            )
            # Each connection the pool opens asks the Sentinels for the current master first
            # (the coalescer's and the event subscription's included).
            client = sentinel.master_for(
                target.service_name,
                db=target.db,
                username=target.username,
                password=target.password,
                **options,
            )
        else:
            # timeout: waiting for a free pooled connection
            pool = aioredis.BlockingConnectionPool.from_url(url, timeout=timeout_s, **options)
            client = aioredis.Redis.from_pool(pool)
        return cls(
            client,
            key_prefix=key_prefix,
            timeout_s=timeout_s,
            replica_ack_timeout_ms=replica_ack_timeout_ms,
            sentinel=sentinel,
        )

    async def close(self) -> None:
        await self._coalescer.close()
        await self._redis.aclose()
        if self._sentinel is not None:
            await self._sentinel.aclose()

    async def _call(self, op: scripts.LuaOp, now_ms: int, *args: str | int) -> Any:
        try:
            return await self._coalescer.call(op.name, now_ms, args)
        except ReplicaAckError as error:
            raise UnavailableError(
                f"Redis ran the {op.name} but no replica acknowledged it within {self._ack_ms} ms "
                "(gpu_broker.replica_ack_timeout_ms; 0 turns the wait off), so a failover could lose it: "
                "retry with the same client_request_id"
            ) from error
        except _REDIS_DOWN as error:
            await self._drop_idle_connections()
            raise UnavailableError(f"Redis unreachable: {error}") from error

    async def _drop_idle_connections(self) -> None:
        """After a connection error, close the idle pooled connections: once Redis is back
        (e.g. restarted), the next calls open fresh ones instead of each failing once on a
        dead socket. The failed call itself is not retried (a retried grant could be a second one)."""
        try:
            await self._redis.connection_pool.disconnect(inuse_connections=False)
        except Exception:
            log.debug("dropping idle Redis connections failed", exc_info=True)

    def _request_key(self, holder: str, client_request_id: str) -> str:
        # Length-prefixed, so ("a:b", "c") and ("a", "b:c") never share a record.
        return f"{self._prefix}:request:{len(holder)}:{holder}:{client_request_id}"

    async def acquire(
        self,
        request: AcquireRequest,
        *,
        now_ms: int,
        lease_id: str,
        ttl_ms: int,
        placement: Placement | None,
        queue_ttl_ms: int = 0,
        best_fit: bool = False,
    ) -> AcquireOutcome:
        """Grant `placement` if it still fits and no waiter comes first; with no placement,
        report the GPUs in scope. With `queue_ttl_ms` > 0 a request that is not granted stays
        queued as waiter `lease_id` for that long (each call refreshes it). With `best_fit` and no
        placement, the script grants the best single-GPU fit itself (one round trip) or reports
        the GPUs in scope."""
        wanted = request.placement
        request_key = ""
        if request.client_request_id:
            request_key = self._request_key(request.holder, request.client_request_id)
        fingerprint = f"{wanted.node}|{wanted.mb}|{sorted(set(wanted.gpus))}|{int(wanted.allow_split)}"
        labels = dict(request.labels)
        reply = await self._call(
            scripts.ACQUIRE,
            now_ms,
            request_key,
            fingerprint,
            max(IDEMPOTENCY_TTL_MS, 2 * ttl_ms),
            wanted.node,
            lease_id,
            request.holder,
            placement.node if placement else "",
            encode_alloc(placement.mb_per_gpu) if placement else ("*" if best_fit else ""),
            ttl_ms,
            json.dumps(labels, sort_keys=True) if labels else "{}",
            request.priority,
            queue_ttl_ms,
            wanted.mb,
            f",{','.join(map(str, wanted.gpus))}," if wanted.gpus else "",
            self._max_token,
        )
        status, reaped, body = reply[0], int(reply[1]), reply[2]
        if status == "granted":  # the script returns only what the caller does not know
            _, _, node, alloc, created_ms, expires_ms, token = reply
            lease = Lease(
                lease_id=lease_id,
                holder=request.holder,
                node=node,
                mb_per_gpu=decode_alloc(alloc),
                labels=labels,
                created_unix_ms=int(created_ms),
                expires_unix_ms=int(expires_ms),
                fencing_token=int(token),
            )
            self._max_token = max(self._max_token, lease.fencing_token)
            return Granted(lease=lease, replayed=False, reaped=reaped)
        if status == "replayed":
            lease = _lease(body)
            self._max_token = max(self._max_token, lease.fencing_token)
            return Granted(lease=lease, replayed=True, reaped=reaped)
        if status == "state":
            return Snapshot(gpus=_gpus(body), reaped=reaped)
        if status == "blocked":
            return Blocked(ahead=int(body), reaped=reaped)
        if status in ("gone", "mismatch"):
            return RequestReused(lease_id=body, mismatch=status == "mismatch", reaped=reaped)
        raise RuntimeError(f"unexpected acquire script reply {status!r}")

    async def renew(self, lease_id: str, *, now_ms: int, fencing_token: int, ttl_ms: int) -> LeaseChange:
        reply = await self._call(scripts.RENEW, now_ms, lease_id, fencing_token, ttl_ms)
        return _change(reply, done="renewed")

    async def release(self, lease_id: str, *, now_ms: int, fencing_token: int) -> LeaseChange:
        reply = await self._call(scripts.RELEASE, now_ms, lease_id, fencing_token)
        return _change(reply, done="released")

    async def reap(self, *, now_ms: int, limit: int = scripts.REAP_BATCH) -> int:
        """Reclaim up to `limit` expired leases; returns how many."""
        return int(await self._call(scripts.REAP, now_ms, limit))

    async def leave_queue(self, waiter: str, *, now_ms: int) -> int:
        """Forget waiting request `waiter` (idempotent); returns how many requests still wait."""
        return int(await self._call(scripts.LEAVE_QUEUE, now_ms, waiter))

    async def next_expiry_ms(self) -> int | None:
        """When the lease that expires first expires (broker clock, ms); None without leases."""
        try:
            async with asyncio.timeout(self._timeout_s):
                first = await self._redis.zrange(f"{self._prefix}:expiry", 0, 0, withscores=True)
        except _REDIS_DOWN as error:
            raise UnavailableError(f"Redis unreachable: {error or 'no reply in time'}") from error
        return int(first[0][1]) if first else None

    async def registered_nodes(self) -> set[str]:
        """The nodes registered in Redis (empty after Redis lost its data)."""
        try:
            async with asyncio.timeout(self._timeout_s):
                members = await self._redis.smembers(f"{self._prefix}:nodes")
            return {str(node) for node in members}  # str already (decode_responses)
        except _REDIS_DOWN as error:
            raise UnavailableError(f"Redis unreachable: {error or 'no reply in time'}") from error

    async def waiting(self) -> int:
        """How many requests wait for memory (records not yet pruned included)."""
        try:
            async with asyncio.timeout(self._timeout_s):
                return int(await self._redis.zcard(f"{self._prefix}:waiters"))
        except _REDIS_DOWN as error:
            raise UnavailableError(f"Redis unreachable: {error or 'no reply in time'}") from error

    async def set_outside(self, node: str, outside_mb: Mapping[int, int], *, now_ms: int) -> int:
        """Record each GPU's memory in use outside live leases; returns GPUs updated."""
        return int(await self._call(scripts.SET_OUTSIDE, now_ms, node, encode_alloc(outside_mb)))

    async def register_node(self, node: str, gpus: Sequence[GpuState], *, now_ms: int) -> list[GpuState]:
        """Set `node`'s GPUs, keeping leased memory; refuses to drop a GPU that holds leases."""
        spec = [
            {
                "index": g.index,
                "total_mb": g.total_mb,
                "reserve_mb": g.reserve_mb,
                "used_outside_mb": g.used_outside_mb,
                "name": g.name,
                "uuid": g.uuid,
            }
            for g in gpus
        ]
        reply = await self._call(scripts.REGISTER, now_ms, node, json.dumps(spec))
        if reply[0] == "busy":
            raise FailedPreconditionError(
                f"node {node!r}: GPU {reply[1]} still holds {reply[2]} MB of live leases; "
                "it cannot be dropped until they are released or expire"
            )
        return _gpus(reply[1])

    async def inventory(self, node: str = "", *, now_ms: int) -> list[GpuState]:
        return _gpus(await self._call(scripts.INVENTORY, now_ms, node))

    async def leases(self, *, now_ms: int, node: str = "", holder: str = "") -> list[Lease]:
        return [_lease(flat) for flat in await self._call(scripts.LIST_LEASES, now_ms, node, holder)]

    async def lease_labels(self, lease_id: str) -> dict[str, str] | None:
        """The labels of lease `lease_id` as stored (None: no such lease record)."""
        try:
            text = await asyncio.wait_for(
                self._redis.hget(f"{self._prefix}:lease:{lease_id}", "labels"), self._timeout_s
            )
        except _REDIS_DOWN as error:
            raise UnavailableError(f"Redis unreachable: {error}") from error
        return None if text is None else dict(json.loads(text or "{}"))

    async def subscribe(self, *, timeout_s: float = 1.0) -> EventSubscription:
        """Subscribe to the events channel; returns once Redis confirmed the subscription."""
        return await EventSubscription.open(self._redis.connection_pool, self.channel, timeout_s=timeout_s)


def _change(reply: Sequence[Any], *, done: str) -> LeaseChange:
    status = reply[0]
    if status == done:
        return LeaseChange(ChangeStatus.DONE, lease=_lease(reply[1]) if len(reply) > 1 else None)
    if status in ("expired", "stale"):
        return LeaseChange(ChangeStatus(status), detail=str(reply[1]) if len(reply) > 1 else "")
    if status == "gone":
        return LeaseChange(ChangeStatus.GONE)
    raise RuntimeError(f"unexpected script reply {status!r}")
