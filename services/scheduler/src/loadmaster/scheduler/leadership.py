"""The scheduler's leader lease in Redis: one scheduler serves, standbys wait to take over.

A lease is one Redis key, `<prefix>:leader`, whose value names the holder (`token holder_id
address`) and which expires `ttl_ms` after the holder's last renewal. Taking it is `SET NX
PX` after `INCR <prefix>:leader_token` (one Lua script), so each takeover gets a fencing token
larger than every earlier one. Renewing and releasing compare the value first (Lua scripts):
a holder whose lease lapsed and was taken can never extend or delete its successor's.

`LeaderElection` decides over a `LeaderStore` with an injected clock: `acquire()` polls until
this scheduler holds the lease; `hold()` renews it and returns once leadership is lost (the
lease was taken, or no renewal was confirmed in time). A holder counts its lease from the
moment it *sent* the renewal, so it believes it leads only while Redis certainly still holds
the key for it, and it steps down `step_down_margin_s` before even that.

`serve_as_leader` runs the gRPC server only while leading (a standby does not listen, so
clients listing every scheduler in one gRPC target reach the leader: docs/deploy.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel

from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.config import LeaderLeaseSettings, Settings
from loadmaster.common.errors import FailedPreconditionError, UnavailableError
from loadmaster.common.grpc_server import GrpcServer
from loadmaster.common.redis_url import is_sentinel_url, parse_sentinel_url
from loadmaster.common.service import default_instance_id

__all__ = [
    "LUA_ACQUIRE",
    "LUA_RELEASE",
    "LUA_RENEW",
    "LeaderElection",
    "LeaderStore",
    "Leadership",
    "LeadershipLostError",
    "RedisLeaderStore",
    "serve_as_leader",
]

log = logging.getLogger(__name__)

# KEYS[1] the lease key, KEYS[2] the fencing-token counter.
# ARGV[1] holder id, ARGV[2] the holder's address, ARGV[3] ttl in ms.
# Returns {token, record}: token > 0 when this call took the lease (record is the value written),
# token 0 when another holds it (record is the holder's value).
LUA_ACQUIRE = """
local current = redis.call('GET', KEYS[1])
if current then
    return {0, current}
end
local token = redis.call('INCR', KEYS[2])
local record = token .. ' ' .. ARGV[1] .. ' ' .. ARGV[2]
redis.call('SET', KEYS[1], record, 'NX', 'PX', ARGV[3])
return {token, record}
"""

# KEYS[1] the lease key. ARGV[1] the record this holder wrote, ARGV[2] ttl in ms.
# Returns 1 when the lease was extended, 0 when it lapsed or is another's.
LUA_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return 1
end
return 0
"""

# KEYS[1] the lease key. ARGV[1] the record this holder wrote.
# Returns 1 when the lease was deleted, 0 when it had lapsed or is another's.
LUA_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


class LeadershipLostError(UnavailableError):
    """This scheduler no longer holds the leader lease; it stops serving."""


@dataclass(frozen=True, slots=True)
class Leadership:
    """One holder's lease: its fencing token grows with every takeover."""

    token: int
    holder_id: str
    address: str

    @property
    def record(self) -> str:
        return f"{self.token} {self.holder_id} {self.address}"

    @classmethod
    def parse(cls, record: str) -> Leadership:
        token, holder_id, address = record.split(" ", 2)
        return cls(int(token), holder_id, address)


class LeaderStore(Protocol):
    async def try_acquire(self, *, holder_id: str, address: str, ttl_ms: int) -> tuple[bool, Leadership]:
        """(True, the new lease) when taken, else (False, the current holder's)."""

    async def renew(self, lease: Leadership, *, ttl_ms: int) -> bool: ...

    async def release(self, lease: Leadership) -> bool: ...


class RedisLeaderStore:
    """Every Redis call of the leader lease."""

    def __init__(self, client: aioredis.Redis, *, key_prefix: str, sentinel: Sentinel | None = None) -> None:
        self._redis = client
        self._sentinel = sentinel
        self._key = f"{key_prefix}:leader"
        self._token_key = f"{key_prefix}:leader_token"
        self._acquire = client.register_script(LUA_ACQUIRE)
        self._renew = client.register_script(LUA_RENEW)
        self._release = client.register_script(LUA_RELEASE)

    @classmethod
    def connect(cls, url: str, *, key_prefix: str, timeout_s: float) -> RedisLeaderStore:
        """A store on `url` (redis:// or redis+sentinel://); each call gives up after `timeout_s`."""
        options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
        if is_sentinel_url(url):
            target = parse_sentinel_url(url)
            sentinel = Sentinel(
                list(target.sentinels), sentinel_kwargs={**options, "password": target.sentinel_password}
            )
            client = sentinel.master_for(
                target.service_name,
                db=target.db,
                username=target.username,
                password=target.password,
                **options,
            )
            return cls(client, key_prefix=key_prefix, sentinel=sentinel)
        return cls(aioredis.Redis.from_url(url, **options), key_prefix=key_prefix)

    async def close(self) -> None:
        await self._redis.aclose()
        if self._sentinel is not None:
            await self._sentinel.aclose()

    async def try_acquire(self, *, holder_id: str, address: str, ttl_ms: int) -> tuple[bool, Leadership]:
        token, record = await self._acquire(
            keys=[self._key, self._token_key], args=[holder_id, address, ttl_ms]
        )
        text = record.decode() if isinstance(record, bytes) else str(record)
        return int(token) > 0, Leadership.parse(text)

    async def renew(self, lease: Leadership, *, ttl_ms: int) -> bool:
        return bool(await self._renew(keys=[self._key], args=[lease.record, ttl_ms]))

    async def release(self, lease: Leadership) -> bool:
        return bool(await self._release(keys=[self._key], args=[lease.record]))


class LeaderElection:
    def __init__(
        self,
        store: LeaderStore,
        *,
        holder_id: str,
        address: str,
        ttl_s: float,
        renew_interval_s: float,
        poll_interval_s: float,
        step_down_margin_s: float | None = None,
        clock: Clock | None = None,
    ) -> None:
        self._store = store
        self._holder_id = holder_id
        self._address = address
        self._ttl_s = ttl_s
        self._renew_interval_s = renew_interval_s
        self._poll_interval_s = poll_interval_s
        self._margin_s = ttl_s * 0.1 if step_down_margin_s is None else step_down_margin_s
        self._clock: Clock = clock or SystemClock()
        self._valid_until = 0.0  # monotonic time up to which this holder surely leads

    @property
    def ttl_ms(self) -> int:
        return max(1, round(self._ttl_s * 1000))

    def leads(self) -> bool:
        return self._clock.monotonic() < self._valid_until - self._margin_s

    async def acquire(self) -> Leadership:
        """Wait until this holder takes the lease; returns it."""
        seen: Leadership | None = None
        while True:
            sent = self._clock.monotonic()
            try:
                taken, lease = await self._store.try_acquire(
                    holder_id=self._holder_id, address=self._address, ttl_ms=self.ttl_ms
                )
            except Exception as error:  # Redis down: keep polling, never lead unconfirmed
                log.warning("leader lease: cannot reach Redis to take the lease: %r", error)
            else:
                if taken:
                    self._valid_until = sent + self._ttl_s
                    log.info("leader lease taken: token %d (%s)", lease.token, lease.address)
                    return lease
                if lease != seen:
                    log.info("standing by: leader is %s (token %d)", lease.address, lease.token)
                    seen = lease
            await self._clock.sleep(self._poll_interval_s)

    async def hold(self, lease: Leadership) -> None:
        """Renew `lease` every `renew_interval_s`; return once leadership is lost."""
        while True:
            left = self._valid_until - self._margin_s - self._clock.monotonic()
            if left <= 0:
                log.error("leader lease token %d: no renewal confirmed in time; stepping down", lease.token)
                return
            await self._clock.sleep(min(self._renew_interval_s, left))
            if not self.leads():
                continue  # the check above steps down
            sent = self._clock.monotonic()
            try:
                renewed = await self._store.renew(lease, ttl_ms=self.ttl_ms)
            except Exception as error:
                log.warning("leader lease token %d: renewal failed: %r", lease.token, error)
                continue
            if not renewed:
                self._valid_until = 0.0
                log.error("leader lease token %d: lapsed and taken; stepping down", lease.token)
                return
            self._valid_until = sent + self._ttl_s

    async def release(self, lease: Leadership) -> None:
        """Give the lease up (a planned stop), so a standby takes over at its next poll."""
        self._valid_until = 0.0
        try:
            await self._store.release(lease)
        except Exception as error:
            log.warning("leader lease token %d: release failed (it lapses by itself): %r", lease.token, error)


async def serve_as_leader(
    settings: Settings, build: Callable[[Settings], GrpcServer], *, clock: Clock | None = None
) -> None:
    """Stand by until this scheduler holds the leader lease, then serve until SIGTERM (the
    lease is released) or until leadership is lost (`LeadershipLostError`: the process exits
    and its supervisor restarts it as a standby)."""
    lease_settings: LeaderLeaseSettings = settings.scheduler.leader_lease
    if not settings.redis_url:
        raise FailedPreconditionError(
            "scheduler.leader_lease.enabled: needs redis_url (the lease lives in Redis)"
        )
    if settings.scheduler.listen is None and "," in settings.scheduler.address:
        raise FailedPreconditionError(
            "scheduler.listen: needed when scheduler.address lists several schedulers (this one's own)"
        )
    store = RedisLeaderStore.connect(
        settings.redis_url,
        key_prefix=lease_settings.key_prefix,
        timeout_s=lease_settings.renew_interval_ms / 1000,
    )
    election = LeaderElection(
        store,
        holder_id=default_instance_id(),
        address=settings.scheduler.listen_address,
        ttl_s=lease_settings.ttl_ms / 1000,
        renew_interval_s=lease_settings.renew_interval_ms / 1000,
        poll_interval_s=lease_settings.poll_interval_ms / 1000,
        clock=clock,
    )
    try:
        lease = await _acquire_unless_stopped(election)
        if lease is None:
            log.info("stopped while standing by")
            return
        server = build(settings)
        holding = asyncio.create_task(election.hold(lease), name="leader-lease")
        serving = asyncio.create_task(server.run(), name="scheduler-server")
        await asyncio.wait({holding, serving}, return_when=asyncio.FIRST_COMPLETED)
        lost = holding.done()
        if lost:
            server.request_stop()  # NOT_SERVING and every session ended at once (drain hooks)
            await serving
        else:
            holding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await holding
            await election.release(lease)
            serving.result()  # re-raise a server failure
    finally:
        await store.close()
    if lost:
        raise LeadershipLostError(f"leader lease token {lease.token} lost")


async def _acquire_unless_stopped(election: LeaderElection) -> Leadership | None:
    """`election.acquire()`, or None on SIGTERM/SIGINT while standing by (nothing to drain)."""
    acquiring = asyncio.create_task(election.acquire(), name="leader-lease-acquire")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(sig, acquiring.cancel)
    try:
        return await acquiring
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if acquiring.cancelled() and (current is None or current.cancelling() == 0):
            return None
        raise
