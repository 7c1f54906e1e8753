"""`LeaseManager`: the broker's core. Validates requests, plans placements with the pure
code in `leases.py`, commits them through `RedisLeaseStore`, and turns store outcomes
into results or `LoadmasterError`s. It keeps no state of its own: Redis is the truth.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import uuid
from collections.abc import Awaitable, Callable, Sequence

from loadmaster.common.clock import Clock
from loadmaster.common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    LoadmasterError,
    ResourceExhaustedError,
    UnavailableError,
)
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.gpu_broker.events import LeaseEventHub
from loadmaster.gpu_broker.leases import (
    AcquireRequest,
    GpuState,
    Lease,
    PlacementRequest,
    can_ever_fit,
    candidate_gpus,
    describe_capacity,
    describe_free,
    plan_placement,
)
from loadmaster.gpu_broker.scripts import MAX_PRIORITY, REAP_BATCH
from loadmaster.gpu_broker.store import (
    AcquireOutcome,
    Blocked,
    ChangeStatus,
    Granted,
    RedisLeaseStore,
    RequestReused,
    Snapshot,
)

__all__ = [
    "MAX_PLACEMENT_ATTEMPTS",
    "MAX_TTL_S",
    "MAX_WAIT_S",
    "WAITER_RECORD_S",
    "WAITER_REFRESH_S",
    "LeaseManager",
]

log = logging.getLogger(__name__)

MAX_TTL_S = 24 * 3600.0
MAX_WAIT_S = 3600.0
# A waiting acquire re-checks at least this often (besides on every lease event), refreshing
# its waiter record, which lapses WAITER_RECORD_S after the last refresh: the waiters of a
# replica that crashed stop blocking the queue within seconds.
WAITER_REFRESH_S = 2.0
WAITER_RECORD_S = 3 * WAITER_REFRESH_S
# A plan loses its race when another grant took the memory between snapshot and commit;
# each loss returns a fresh snapshot. Past this many losses the caller is told to retry.
MAX_PLACEMENT_ATTEMPTS = 8
_MAX_REAP_BATCHES = 20  # per reap() call; the rest waits for the next one
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")
_MAX_TEXT = 256
_MAX_LABELS_BYTES = 4096
_MAX_GPU_INDEX = 2**32 - 1  # uint32 on the wire


class LeaseManager:
    def __init__(
        self,
        store: RedisLeaseStore,
        *,
        clock: Clock,
        default_ttl_s: float,
        default_reserve_mb: int,
        telemetry: TelemetryReporter | None = None,
        hub: LeaseEventHub | None = None,
    ) -> None:
        self._store = store
        self._hub = hub
        self._clock = clock
        self._default_ttl_s = default_ttl_s
        self._default_reserve_mb = default_reserve_mb
        self._telemetry = telemetry
        self._on_grant: Callable[[int], None] | None = None
        self._on_release: Callable[[], None] | None = None
        self._on_no_gpus: Callable[[], Awaitable[bool]] | None = None

    def on_grant(self, callback: Callable[[int], None]) -> None:
        """Call `callback(expires_unix_ms)` for each lease this replica grants (the reaper
        wakes for one that expires before its next step)."""
        self._on_grant = callback

    def on_release(self, callback: Callable[[], None]) -> None:
        """Call `callback()` each time this replica frees a lease's memory (a release, or an
        expired lease found by a release)."""
        self._on_release = callback

    def on_no_gpus(self, callback: Callable[[], Awaitable[bool]]) -> None:
        """`await callback()` when an Acquire or Inventory finds no GPU where it looked: the
        reaper registers this broker's nodes again when Redis lost them, and says whether it
        did (then the call looks once more)."""
        self._on_no_gpus = callback

    async def _registered_again(self) -> bool:
        return self._on_no_gpus is not None and await self._on_no_gpus()

    def now_ms(self) -> int:
        return int(self._clock.time() * 1000)

    async def register_node(self, node: str, gpus: Sequence[GpuState]) -> list[GpuState]:
        """Set `node`'s GPUs (leased_mb ignored; reserve 0 = the broker's default). Keeps live leases."""
        _check_name("node", node)
        indexes = [g.index for g in gpus]
        if len(set(indexes)) != len(indexes):
            raise InvalidArgumentError(f"node {node!r}: GPU indexes repeat: {sorted(indexes)}")
        spec = []
        for g in gpus:
            if not 0 <= g.index <= _MAX_GPU_INDEX:  # the best-fit index keys it as 10 digits
                raise InvalidArgumentError(f"node {node!r}: GPU index {g.index} is not a uint32")
            if g.total_mb <= 0:
                raise InvalidArgumentError(f"node {node!r} GPU {g.index}: total_mb must be > 0")
            reserve = g.reserve_mb or self._default_reserve_mb
            spec.append(
                GpuState(
                    node=node,
                    index=g.index,
                    total_mb=g.total_mb,
                    reserve_mb=reserve,
                    used_outside_mb=g.used_outside_mb,
                    name=g.name,
                    uuid=g.uuid,
                )
            )
        return await self._store.register_node(node, spec, now_ms=self.now_ms())

    async def acquire(self, request: AcquireRequest) -> Lease:
        """Grant `request`, or raise. With `wait_s` > 0 a request that does not fit (or has
        waiting requests ahead of it) queues in Redis and is re-tried on every lease event
        until it is granted or `wait_s` passes; one that could never fit fails at once."""
        _check_acquire(request)
        started = self._clock.monotonic()
        ttl_ms = self._ttl_ms(request.ttl_s)
        lease_id = uuid.uuid4().hex
        if request.wait_s <= 0:
            result = await self._attempt(request, lease_id=lease_id, ttl_ms=ttl_ms, queue_ttl_ms=0)
            if isinstance(result, LoadmasterError):
                raise result
            self._granted(request, result, started)
            return result.lease
        deadline = started + request.wait_s
        queued = False
        wakeups = self._hub.wakeups() if self._hub is not None else contextlib.nullcontext(asyncio.Event())
        try:
            with wakeups as wake:
                while True:
                    wake.clear()
                    queue_ttl_ms = round(WAITER_RECORD_S * 1000) if queued else 0
                    result = await self._attempt(
                        request, lease_id=lease_id, ttl_ms=ttl_ms, queue_ttl_ms=queue_ttl_ms
                    )
                    if isinstance(result, Granted):
                        queued = False  # the grant removed the waiter record
                        self._granted(request, result, started)
                        return result.lease
                    remaining = deadline - self._clock.monotonic()
                    if remaining <= 0:
                        raise ResourceExhaustedError(
                            f"waited {request.wait_s:g} s without a grant: {result.message}"
                        )
                    if not queued:
                        queued = True  # queue now, and re-check at once (nothing is missed)
                        continue
                    await self._wait(wake, min(remaining, WAITER_REFRESH_S))
        finally:
            if queued:
                await self._leave_queue(lease_id)

    async def _attempt(
        self, request: AcquireRequest, *, lease_id: str, ttl_ms: int, queue_ttl_ms: int
    ) -> Granted | ResourceExhaustedError:
        """One snapshot -> plan -> commit round. Returns the grant, or the error a request that
        does not wait gets; raises for errors that waiting cannot cure."""

        def best_fit() -> Awaitable[AcquireOutcome]:  # the common case is granted in this one call
            return self._store.acquire(
                request,
                now_ms=self.now_ms(),
                lease_id=lease_id,
                ttl_ms=ttl_ms,
                placement=None,
                queue_ttl_ms=queue_ttl_ms,
                best_fit=True,
            )

        outcome = await best_fit()
        if isinstance(outcome, Snapshot) and not outcome.gpus and await self._registered_again():
            outcome = await best_fit()  # Redis had lost the node's GPUs: registered again
        attempts = 0
        while True:
            self._count_expirations(outcome.reaped)
            if isinstance(outcome, Granted):
                return outcome
            if isinstance(outcome, Blocked):
                return ResourceExhaustedError(
                    f"{outcome.ahead} waiting request(s) of equal or higher priority come first "
                    f"for {_where(request.placement)}"
                )
            if not isinstance(outcome, Snapshot):
                raise _reused_error(request, outcome)
            placement = plan_placement(outcome.gpus, request.placement)
            if placement is None:
                if not can_ever_fit(outcome.gpus, request.placement):
                    raise ResourceExhaustedError(
                        f"{request.placement.mb} MB can never fit on {_where(request.placement)}: "
                        f"even with no leases the most it could get is "
                        f"{describe_capacity(candidate_gpus(outcome.gpus, request.placement), request.placement)}; "
                        f"free now per GPU: {describe_free(candidate_gpus(outcome.gpus, request.placement))}"
                    )
                return ResourceExhaustedError(_exhausted_message(outcome.gpus, request.placement))
            if attempts == MAX_PLACEMENT_ATTEMPTS:
                raise UnavailableError(
                    f"could not place {request.placement.mb} MB: concurrent grants took the memory "
                    f"first {attempts} times; retry"
                )
            attempts += 1
            outcome = await self._store.acquire(
                request,
                now_ms=self.now_ms(),
                lease_id=lease_id,
                ttl_ms=ttl_ms,
                placement=placement,
                queue_ttl_ms=queue_ttl_ms,
            )

    def _granted(self, request: AcquireRequest, outcome: Granted, started: float) -> None:
        if self._on_grant is not None:
            self._on_grant(outcome.lease.expires_unix_ms)
        if outcome.replayed:
            log.info("acquire %s replayed: lease %s", request.client_request_id, outcome.lease.lease_id)
        else:
            self._record("grant_latency_ms", (self._clock.monotonic() - started) * 1000)

    async def _wait(self, wake: asyncio.Event, timeout_s: float) -> None:
        """Until a lease event arrives or `timeout_s` passes on the injected clock."""
        waiters = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(self._clock.sleep(timeout_s))]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waiters:
                task.cancel()

    async def _leave_queue(self, waiter: str) -> None:
        try:
            await self._store.leave_queue(waiter, now_ms=self.now_ms())
        except LoadmasterError as error:  # the record lapses by itself
            log.warning("could not dequeue waiting acquire %s: %s", waiter, error.message)

    async def waiting(self) -> int:
        return await self._store.waiting()

    async def next_expiry_ms(self) -> int | None:
        return await self._store.next_expiry_ms()

    async def set_outside(self, node: str, outside_mb: dict[int, int]) -> int:
        return await self._store.set_outside(node, outside_mb, now_ms=self.now_ms())

    async def renew(self, lease_id: str, *, fencing_token: int, ttl_s: float = 0.0) -> Lease:
        _check_lease_ref(lease_id, fencing_token)
        change = await self._store.renew(
            lease_id, now_ms=self.now_ms(), fencing_token=fencing_token, ttl_ms=self._ttl_ms(ttl_s)
        )
        if change.status is ChangeStatus.DONE and change.lease is not None:
            return change.lease
        if change.status is ChangeStatus.EXPIRED:
            self._count_expirations(1)
            raise FailedPreconditionError(
                f"lease {lease_id} expired at {change.detail} (unix ms) and its memory was reclaimed; "
                "stop using it and acquire a new lease"
            )
        if change.status is ChangeStatus.STALE:
            raise self._stale(lease_id, fencing_token, change.detail)
        raise FailedPreconditionError(
            f"lease {lease_id} is not live (released, expired, or never granted); acquire a new lease"
        )

    async def renew_many(self, renewals: Sequence[tuple[str, int, float]]) -> list[Lease | LoadmasterError]:
        """Renew each `(lease_id, fencing_token, ttl_s)`; per renewal the lease, or the error
        `renew` raises for it. Their scripts leave Redis in one pipeline (the store coalesces
        calls made together); each stays atomic on its own."""

        async def one(lease_id: str, token: int, ttl_s: float) -> Lease | LoadmasterError:
            try:
                return await self.renew(lease_id, fencing_token=token, ttl_s=ttl_s)
            except LoadmasterError as error:
                return error

        return list(await asyncio.gather(*(one(*renewal) for renewal in renewals)))

    async def release(self, lease_id: str, *, fencing_token: int) -> bool:
        """True when this call freed the lease; False when it was already gone (idempotent)."""
        _check_lease_ref(lease_id, fencing_token)
        change = await self._store.release(lease_id, now_ms=self.now_ms(), fencing_token=fencing_token)
        if change.status is ChangeStatus.STALE:
            raise self._stale(lease_id, fencing_token, change.detail)
        if change.status is ChangeStatus.EXPIRED:
            self._count_expirations(1)
        freed = change.status in (ChangeStatus.DONE, ChangeStatus.EXPIRED)
        if freed and self._on_release is not None:
            self._on_release()
        return change.status is ChangeStatus.DONE

    async def lease_labels(self, lease_id: str) -> dict[str, str] | None:
        """The labels lease `lease_id` was granted with; None when Redis holds no such lease."""
        return await self._store.lease_labels(lease_id)

    async def leases(self, *, node: str = "", holder: str = "") -> list[Lease]:
        return await self._store.leases(now_ms=self.now_ms(), node=node, holder=holder)

    async def inventory(self, node: str = "") -> list[GpuState]:
        gpus = await self._store.inventory(node, now_ms=self.now_ms())
        if not gpus and await self._registered_again():
            gpus = await self._store.inventory(node, now_ms=self.now_ms())
        return gpus

    async def registered_nodes(self) -> set[str]:
        return await self._store.registered_nodes()

    async def reap(self) -> int:
        """Reclaim every expired lease (in batches); returns how many."""
        total = 0
        for _ in range(_MAX_REAP_BATCHES):
            reaped = await self._store.reap(now_ms=self.now_ms())
            total += reaped
            if reaped < REAP_BATCH:
                break
        self._count_expirations(total)
        return total

    def _ttl_ms(self, ttl_s: float) -> int:
        if math.isnan(ttl_s) or ttl_s < 0 or ttl_s > MAX_TTL_S:
            raise InvalidArgumentError(f"ttl_s must be between 0 (default) and {MAX_TTL_S:.0f}, got {ttl_s}")
        return max(1, round((ttl_s or self._default_ttl_s) * 1000))

    def _stale(self, lease_id: str, token: int, current: str) -> FailedPreconditionError:
        self._record("fencing_rejections", 1)
        return FailedPreconditionError(
            f"lease {lease_id}: fencing token {token} is stale (the lease holds token {current})"
        )

    def _count_expirations(self, count: int) -> None:
        if count:
            self._record("lease_expirations", count)

    def _record(self, name: str, value: float) -> None:
        if self._telemetry is not None:
            self._telemetry.record(name, value)


def _check_name(what: str, value: str) -> None:
    if not _NAME.match(value):
        raise InvalidArgumentError(
            f"{what} {value!r} is not a valid name (1-128 of letters, digits and ._:@/-)"
        )


def _check_acquire(request: AcquireRequest) -> None:
    wanted = request.placement
    if not request.holder or len(request.holder) > _MAX_TEXT:
        raise InvalidArgumentError(f"holder is required (at most {_MAX_TEXT} characters)")
    if len(request.client_request_id) > _MAX_TEXT:
        raise InvalidArgumentError(f"client_request_id is longer than {_MAX_TEXT} characters")
    if wanted.mb <= 0:
        raise InvalidArgumentError("mb must be > 0")
    if wanted.node:
        _check_name("node", wanted.node)
    elif wanted.gpus:
        raise InvalidArgumentError("gpus are indexes on one node: give node as well")
    if math.isnan(request.wait_s) or not 0 <= request.wait_s <= MAX_WAIT_S:
        raise InvalidArgumentError(
            f"wait_s must be between 0 (no wait) and {MAX_WAIT_S:.0f}, got {request.wait_s}"
        )
    if not 0 <= request.priority <= MAX_PRIORITY:
        raise InvalidArgumentError(f"priority must be between 0 and {MAX_PRIORITY}, got {request.priority}")
    if sum(len(k) + len(v) for k, v in request.labels.items()) > _MAX_LABELS_BYTES:
        raise InvalidArgumentError(f"labels are larger than {_MAX_LABELS_BYTES} bytes")


def _reused_error(request: AcquireRequest, outcome: RequestReused) -> LoadmasterError:
    if outcome.mismatch:
        return InvalidArgumentError(
            f"client_request_id {request.client_request_id!r} was already used by "
            f"{request.holder!r} with other parameters (lease {outcome.lease_id})"
        )
    return FailedPreconditionError(
        f"client_request_id {request.client_request_id!r} already produced lease "
        f"{outcome.lease_id}, which has since been released or expired; "
        "use a new client_request_id to acquire again"
    )


def _check_lease_ref(lease_id: str, fencing_token: int) -> None:
    if not lease_id or len(lease_id) > _MAX_TEXT:
        raise InvalidArgumentError("lease_id is required")
    if fencing_token <= 0:
        raise InvalidArgumentError("fencing_token is required (the token Acquire returned)")


def _where(wanted: PlacementRequest) -> str:
    where = f"node {wanted.node!r}" if wanted.node else "any node"
    if wanted.gpus:
        where += f" GPU {', '.join(map(str, sorted(set(wanted.gpus))))}"
    return where


def _exhausted_message(gpus: Sequence[GpuState], wanted: PlacementRequest) -> str:
    split = ", split allowed" if wanted.allow_split else ""
    return (
        f"cannot fit {wanted.mb} MB on {_where(wanted)}{split}; "
        f"free per GPU: {describe_free(candidate_gpus(gpus, wanted))}"
    )
