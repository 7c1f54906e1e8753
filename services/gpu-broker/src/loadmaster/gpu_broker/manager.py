"""`LeaseManager`: the broker's core. Validates requests, plans placements with the pure
code in `leases.py`, commits them through `RedisLeaseStore`, and turns store outcomes
into results or `LoadmasterError`s. It keeps no state of its own: Redis is the truth.
"""

from __future__ import annotations

import logging
import math
import re
import uuid
from collections.abc import Sequence

from loadmaster.common.clock import Clock
from loadmaster.common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    LoadmasterError,
    ResourceExhaustedError,
    UnavailableError,
)
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.gpu_broker.leases import (
    AcquireRequest,
    GpuState,
    Lease,
    PlacementRequest,
    candidate_gpus,
    describe_free,
    plan_placement,
)
from loadmaster.gpu_broker.scripts import REAP_BATCH
from loadmaster.gpu_broker.store import ChangeStatus, Granted, RedisLeaseStore, RequestReused, Snapshot

__all__ = ["MAX_PLACEMENT_ATTEMPTS", "MAX_TTL_S", "LeaseManager"]

log = logging.getLogger(__name__)

MAX_TTL_S = 24 * 3600.0
# A plan loses its race when another grant took the memory between snapshot and commit;
# each loss returns a fresh snapshot. Past this many losses the caller is told to retry.
MAX_PLACEMENT_ATTEMPTS = 8
_MAX_REAP_BATCHES = 20  # per reap() call; the rest waits for the next one
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")
_MAX_TEXT = 256
_MAX_LABELS_BYTES = 4096


class LeaseManager:
    def __init__(
        self,
        store: RedisLeaseStore,
        *,
        clock: Clock,
        default_ttl_s: float,
        default_reserve_mb: int,
        telemetry: TelemetryReporter | None = None,
    ) -> None:
        self._store = store
        self._clock = clock
        self._default_ttl_s = default_ttl_s
        self._default_reserve_mb = default_reserve_mb
        self._telemetry = telemetry

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
        _check_acquire(request)
        started = self._clock.monotonic()
        ttl_ms = self._ttl_ms(request.ttl_s)
        lease_id = uuid.uuid4().hex
        outcome = await self._store.acquire(
            request, now_ms=self.now_ms(), lease_id=lease_id, ttl_ms=ttl_ms, placement=None
        )
        attempts = 0
        while True:
            self._count_expirations(outcome.reaped)
            if isinstance(outcome, Granted):
                if outcome.replayed:
                    log.info(
                        "acquire %s replayed: lease %s", request.client_request_id, outcome.lease.lease_id
                    )
                else:
                    self._record("grant_latency_ms", (self._clock.monotonic() - started) * 1000)
                return outcome.lease
            if not isinstance(outcome, Snapshot):
                raise _reused_error(request, outcome)
            placement = plan_placement(outcome.gpus, request.placement)
            if placement is None:
                raise ResourceExhaustedError(_exhausted_message(outcome.gpus, request.placement))
            if attempts == MAX_PLACEMENT_ATTEMPTS:
                raise UnavailableError(
                    f"could not place {request.placement.mb} MB: concurrent grants took the memory "
                    f"first {attempts} times; retry"
                )
            attempts += 1
            outcome = await self._store.acquire(
                request, now_ms=self.now_ms(), lease_id=lease_id, ttl_ms=ttl_ms, placement=placement
            )

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

    async def release(self, lease_id: str, *, fencing_token: int) -> bool:
        """True when this call freed the lease; False when it was already gone (idempotent)."""
        _check_lease_ref(lease_id, fencing_token)
        change = await self._store.release(lease_id, now_ms=self.now_ms(), fencing_token=fencing_token)
        if change.status is ChangeStatus.STALE:
            raise self._stale(lease_id, fencing_token, change.detail)
        if change.status is ChangeStatus.EXPIRED:
            self._count_expirations(1)
        return change.status is ChangeStatus.DONE

    async def leases(self, *, node: str = "", holder: str = "") -> list[Lease]:
        return await self._store.leases(now_ms=self.now_ms(), node=node, holder=holder)

    async def inventory(self, node: str = "") -> list[GpuState]:
        return await self._store.inventory(node, now_ms=self.now_ms())

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


def _exhausted_message(gpus: Sequence[GpuState], wanted: PlacementRequest) -> str:
    where = f"node {wanted.node!r}" if wanted.node else "any node"
    if wanted.gpus:
        where += f" GPU {', '.join(map(str, sorted(set(wanted.gpus))))}"
    split = ", split allowed" if wanted.allow_split else ""
    return (
        f"cannot fit {wanted.mb} MB on {where}{split}; "
        f"free per GPU: {describe_free(candidate_gpus(gpus, wanted))}"
    )
