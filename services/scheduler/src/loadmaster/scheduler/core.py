"""The scheduler's decisions: admission, dispatch, retries, expiry, cold starts.

`SchedulerCore` is synchronous and owns no I/O. Callers feed it what arrived on the
streams (a gateway batch, a worker hello/report/loss, a session loss, "the timer
fired") and it answers through an `Outbound` sink (grants, rejects, worker commands).
After each call the caller re-arms one timer at `next_deadline()`.

Every admitted request ends exactly once: a Reject, or a Grant whose Complete is
final (success or non-retryable failure). A retryable failure re-queues the
request (same arrival, same deadline) while attempts <= max_retries.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from loadmaster.common.clock import Clock
from loadmaster.common.config import Settings
from loadmaster.scheduler import placement
from loadmaster.scheduler.domain import (
    HOLDING_STATES,
    Completion,
    Grant,
    LoadModel,
    OverflowPolicy,
    QueueStats,
    Reject,
    Request,
    RequestInfo,
    RequestKey,
    SlotState,
    SlotStatus,
    WorkerCommand,
    WorkerHello,
    WorkerView,
)
from loadmaster.scheduler.queues import RequestQueues
from loadmaster.scheduler.registry import WorkerRegistry
from loadmaster.scheduler.strategies import Ordering, PriorityOrdering
from loadmaster.v1 import errors_pb2

__all__ = ["CoreConfig", "Outbound", "SchedulerCore", "Telemetry"]

log = logging.getLogger(__name__)

_OK = errors_pb2.ERROR_CODE_UNSPECIFIED
_UNAVAILABLE = errors_pb2.ERROR_CODE_UNAVAILABLE


class Outbound(Protocol):
    """Where the core's answers go (the session layer routes them to streams)."""

    def grant(self, session_id: int, grant: Grant) -> None: ...

    def reject(self, session_id: int, reject: Reject) -> None: ...

    def command(self, worker_id: str, command: WorkerCommand) -> None: ...


class Telemetry(Protocol):
    def record(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None: ...


class _NoTelemetry:
    def record(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        pass


@dataclass(frozen=True, slots=True)
class CoreConfig:
    max_queue_size: int = 1000
    request_ttl_ms: float = 5000.0
    overflow_policy: OverflowPolicy = OverflowPolicy.DROP_OLDEST
    max_retries: int = 1
    max_inflight: Callable[[str], int] = lambda model_id: 2  # per worker, per model

    @classmethod
    def from_settings(cls, settings: Settings) -> CoreConfig:
        s = settings.scheduler
        models = settings.models
        limits: dict[str, int] = {}  # settings do not change while the service runs

        def max_inflight(model_id: str) -> int:
            limit = limits.get(model_id)
            if limit is None:
                limit = limits[model_id] = models.for_model(model_id).max_inflight
            return limit

        return cls(
            max_queue_size=s.max_queue_size,
            request_ttl_ms=s.request_ttl_ms,
            overflow_policy=OverflowPolicy(s.overflow_policy),
            max_retries=s.max_retries,
            max_inflight=max_inflight,
        )


@dataclass(slots=True)
class _Tracked:
    request: Request
    attempts: int = 0
    worker_id: str | None = None  # set while granted


@dataclass(slots=True)
class _ModelStats:
    expired: int = 0
    overflowed: int = 0
    granted: int = 0


@dataclass(frozen=True, slots=True)
class _PendingLoad:
    """A LoadCommand sent and not yet answered by a LOADING/READY report or a failure."""

    worker_id: str
    baseline: tuple[SlotState, str, int]  # the slot's (state, error, generation) when commanded


def _slot_key(slot: SlotStatus | None) -> tuple[SlotState, str, int]:
    """What tells one load attempt's outcome from another's (a worker bumps the generation per load)."""
    if slot is None:
        return (SlotState.IDLE, "", 0)
    return (slot.state, slot.error, slot.generation)


class SchedulerCore:
    def __init__(
        self,
        config: CoreConfig,
        *,
        clock: Clock,
        outbound: Outbound,
        ordering: Ordering | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self._config = config
        self._clock = clock
        self._out = outbound
        self._telemetry: Telemetry = telemetry if telemetry is not None else _NoTelemetry()
        self._queues = RequestQueues(ordering if ordering is not None else PriorityOrdering())
        self._registry = WorkerRegistry()
        self._tracked: dict[RequestKey, _Tracked] = {}
        self._stats: dict[str, _ModelStats] = {}
        self._pending_loads: dict[str, _PendingLoad] = {}
        self._arrivals = itertools.count()

    # ---- gateway side ------------------------------------------------------------

    def submit(
        self,
        session_id: int,
        *,
        enqueues: Sequence[RequestInfo] = (),
        completes: Sequence[Completion] = (),
        cancels: Sequence[str] = (),
    ) -> None:
        """One batch from a gateway session; dispatches once at the end."""
        touched: set[str] = set()
        for info in enqueues:
            self._enqueue(session_id, info, touched)
        for completion in completes:
            self._complete(session_id, completion, touched)
        for request_id in cancels:
            self._cancel((session_id, request_id))
        self._dispatch(touched)

    def close_session(self, session_id: int) -> None:
        """The gateway is gone: drop its waiting requests silently, free its grants."""
        touched: set[str] = set()
        for key, tracked in list(self._tracked.items()):
            if key[0] != session_id:
                continue
            del self._tracked[key]
            if tracked.worker_id is None:
                self._queues.remove(key)
            else:
                self._registry.release(tracked.worker_id, key)
                touched.add(tracked.request.model_id)
        self._dispatch(touched)

    # ---- worker side -------------------------------------------------------------

    def add_worker(self, hello: WorkerHello) -> None:
        """A worker said hello; one that reconnects under the same id replaces the old one."""
        if self._registry.get(hello.worker_id) is not None:
            self.remove_worker(hello.worker_id)
        self._registry.add(hello)
        self._dispatch(self._queues.waiting_models())

    def update_worker(self, worker_id: str, slots: Sequence[SlotStatus]) -> None:
        """A worker's full slot report."""
        if self._registry.get(worker_id) is None:
            return
        previous = self._registry.report(worker_id, slots)
        current = {slot.model_id: slot for slot in slots}
        failures: dict[str, str] = {}
        for model_id, pending in list(self._pending_loads.items()):
            if pending.worker_id != worker_id:
                continue
            seen = _slot_key(current.get(model_id))
            state, error, _ = seen
            if state in HOLDING_STATES:
                del self._pending_loads[model_id]
            elif error and seen != pending.baseline:  # a new failure, even if LOADING went unseen
                del self._pending_loads[model_id]
                failures[model_id] = error
        for model_id, slot in current.items():
            before = previous.get(model_id)
            was_loading = before is not None and before.state is SlotState.LOADING
            if was_loading and slot.error and slot.state not in HOLDING_STATES:
                failures.setdefault(model_id, slot.error)
        for model_id, error in failures.items():
            log.warning("model %s failed to load on worker %s: %s", model_id, worker_id, error)
            if not self._registry.holds(model_id):
                self._reject_waiters(model_id, f"model {model_id!r} failed to load on {worker_id}: {error}")
        self._dispatch(self._queues.waiting_models())

    def remove_worker(self, worker_id: str) -> None:
        """A worker's stream ended: re-queue (or reject) what it was granted, load elsewhere."""
        record = self._registry.remove(worker_id)
        if record is None:
            return
        for model_id, pending in list(self._pending_loads.items()):
            if pending.worker_id == worker_id:
                del self._pending_loads[model_id]
        touched: set[str] = set()
        for key in record.granted:
            tracked = self._tracked.get(key)
            if tracked is not None:
                tracked.worker_id = None
                self._retry_or_reject(tracked, _UNAVAILABLE, f"worker {worker_id} disconnected", touched)
        self._dispatch(set(self._queues.waiting_models()) | touched)

    # ---- time --------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """The earliest deadline among waiting requests (clock.monotonic scale)."""
        return self._queues.next_deadline()

    def expire_due(self) -> None:
        """Reject every waiting request whose deadline has come."""
        for request in self._queues.pop_expired(self._clock.monotonic()):
            self._expire(request)

    # ---- admin -------------------------------------------------------------------

    @property
    def strategy(self) -> str:
        return self._queues.ordering.name

    def workers(self) -> list[WorkerView]:
        return [
            WorkerView(record.hello, tuple(record.slots.values()))
            for record in sorted(self._registry, key=lambda r: r.worker_id)
        ]

    def queue_stats(self) -> list[QueueStats]:
        return [
            QueueStats(
                model_id=model_id,
                depth=self._queues.depth(model_id),
                inflight=self._registry.inflight(model_id),
                expired=stats.expired,
                overflowed=stats.overflowed,
                granted=stats.granted,
            )
            for model_id, stats in sorted(self._stats.items())
        ]

    # ---- internals ---------------------------------------------------------------

    def _enqueue(self, session_id: int, info: RequestInfo, touched: set[str]) -> None:
        key = (session_id, info.request_id)
        model_id = info.model_id
        if not info.request_id:
            log.warning("session %d enqueued a request without request_id; ignored", session_id)
            return
        if not model_id:
            self._reject_key(key, errors_pb2.ERROR_CODE_INVALID_ARGUMENT, "model_id is required")
            return
        if key in self._tracked:
            log.warning("duplicate request id %r in session %d", info.request_id, session_id)
            self._reject_key(
                key, errors_pb2.ERROR_CODE_INVALID_ARGUMENT, f"request id {info.request_id!r} is in use"
            )
            return
        if len(self._registry) == 0:
            self._reject_key(key, _UNAVAILABLE, "no model-pool worker connected")
            return
        if not self._registry.knows(model_id):
            self._reject_key(
                key,
                errors_pb2.ERROR_CODE_NOT_FOUND,
                f"model {model_id!r} is not in any connected worker's repository",
            )
            return
        ttl_ms = self._config.request_ttl_ms
        if info.timeout_ms > 0:
            ttl_ms = min(ttl_ms, info.timeout_ms)
        now = self._clock.monotonic()
        request = Request(
            key=key,
            info=info,
            arrival=next(self._arrivals),
            enqueued_at=now,
            deadline=now + ttl_ms / 1000.0,
            deadline_unix_ns=int((self._clock.time() + ttl_ms / 1000.0) * 1e9),
        )
        stats = self._stats_for(model_id)
        if self._queues.depth(model_id) >= self._config.max_queue_size:
            stats.overflowed += 1
            self._telemetry.record("queue_full_drops", 1, {"model": model_id})
            full = f"queue for model {model_id!r} is full ({self._config.max_queue_size} waiting)"
            if self._config.overflow_policy is OverflowPolicy.REJECT_NEWEST:
                self._reject_key(key, errors_pb2.ERROR_CODE_OVERFLOW, full)
                return
            oldest = self._queues.pop_oldest(model_id)
            if oldest is not None:
                del self._tracked[oldest.key]
                self._reject_key(oldest.key, errors_pb2.ERROR_CODE_OVERFLOW, f"{full}; dropped the oldest")
        self._tracked[key] = _Tracked(request)
        self._queues.push(request)
        touched.add(model_id)

    def _complete(self, session_id: int, completion: Completion, touched: set[str]) -> None:
        key = (session_id, completion.request_id)
        tracked = self._tracked.get(key)
        if tracked is None or tracked.worker_id is None:
            return  # unknown, or a late report for an attempt already re-queued
        if completion.worker_id and completion.worker_id != tracked.worker_id:
            return  # a late reply from an earlier attempt's worker
        self._registry.release(tracked.worker_id, key)
        tracked.worker_id = None
        touched.add(tracked.request.model_id)
        if completion.error_code == _OK or not completion.retryable:
            del self._tracked[key]
            return
        reason = errors_pb2.ErrorCode.Name(completion.error_code).removeprefix("ERROR_CODE_").lower()
        self._retry_or_reject(tracked, completion.error_code, reason, touched)

    def _cancel(self, key: RequestKey) -> None:
        tracked = self._tracked.get(key)
        if tracked is not None and tracked.worker_id is None:
            del self._tracked[key]
            self._queues.remove(key)

    def _retry_or_reject(self, tracked: _Tracked, error_code: int, reason: str, touched: set[str]) -> None:
        """A granted attempt failed retryably: queue it again, or give the final answer."""
        request = tracked.request
        retries_left = tracked.attempts <= self._config.max_retries
        in_time = request.deadline > self._clock.monotonic()
        if retries_left and in_time:
            self._queues.push(request)  # over max_queue_size if need be: it was admitted already
            touched.add(request.model_id)
            return
        del self._tracked[request.key]
        attempts = "attempt" if tracked.attempts == 1 else "attempts"
        message = f"request failed after {tracked.attempts} {attempts}: {reason}"
        if retries_left:
            message += " (no time left to retry)"
        self._reject_key(request.key, error_code, message)

    def _dispatch(self, models: Iterable[str]) -> None:
        now = self._clock.monotonic()
        for model_id in models:
            self._dispatch_model(model_id, now)
            if model_id in self._stats:
                self._telemetry.record("queue_depth", self._queues.depth(model_id), {"model": model_id})

    def _dispatch_model(self, model_id: str, now: float) -> None:
        queues = self._queues
        max_inflight = self._config.max_inflight(model_id)
        while (head := queues.peek(model_id)) is not None:
            if head.deadline <= now:
                queues.remove(head.key)
                self._expire(head)
                continue
            worker_id = placement.pick_grant_worker(
                self._registry.grant_candidates(model_id), max_inflight=max_inflight
            )
            if worker_id is None:
                break
            queues.remove(head.key)
            self._grant(self._tracked[head.key], worker_id, now)
        if (
            queues.depth(model_id)
            and model_id not in self._pending_loads
            and not self._registry.holds(model_id)
        ):
            self._command_load(model_id)

    def _grant(self, tracked: _Tracked, worker_id: str, now: float) -> None:
        request = tracked.request
        model_id = request.model_id
        record = self._registry.get(worker_id)
        assert record is not None
        slot = record.slots[model_id]
        self._registry.acquire(worker_id, request.key, model_id)
        tracked.worker_id = worker_id
        tracked.attempts += 1
        self._stats_for(model_id).granted += 1
        self._out.grant(
            request.session_id,
            Grant(
                request_id=request.request_id,
                worker_id=worker_id,
                data_endpoint=record.hello.data_endpoint,
                generation=slot.generation,
                deadline_unix_ns=request.deadline_unix_ns,
                attempt=tracked.attempts,
            ),
        )
        self._telemetry.record(
            "scheduling_wait_ms", (now - request.enqueued_at) * 1000.0, {"model": model_id}
        )
        self._telemetry.record("grants", 1, {"model": model_id, "worker": worker_id})

    def _command_load(self, model_id: str) -> None:
        worker_id = placement.pick_load_worker(self._registry.load_candidates(model_id))
        if worker_id is None:
            return  # nobody can load it now; waiters expire unless a worker turns up
        record = self._registry.get(worker_id)
        assert record is not None
        self._pending_loads[model_id] = _PendingLoad(worker_id, _slot_key(record.slots.get(model_id)))
        log.info("commanding worker %s to load model %s", worker_id, model_id)
        self._out.command(worker_id, LoadModel(model_id))
        self._telemetry.record("loads_commanded", 1, {"model": model_id, "worker": worker_id})

    def _reject_waiters(self, model_id: str, message: str) -> None:
        while (request := self._queues.pop(model_id)) is not None:
            del self._tracked[request.key]
            self._reject_key(request.key, _UNAVAILABLE, message)

    def _expire(self, request: Request) -> None:
        del self._tracked[request.key]
        model_id = request.model_id
        self._stats_for(model_id).expired += 1
        self._telemetry.record("requests_expired", 1, {"model": model_id})
        waited_ms = (self._clock.monotonic() - request.enqueued_at) * 1000.0
        self._reject_key(
            request.key,
            errors_pb2.ERROR_CODE_EXPIRED,
            f"expired after waiting {waited_ms:.0f} ms for model {model_id!r}",
        )

    def _reject_key(self, key: RequestKey, error_code: int, message: str) -> None:
        self._out.reject(key[0], Reject(request_id=key[1], error_code=error_code, message=message))

    def _stats_for(self, model_id: str) -> _ModelStats:
        stats = self._stats.get(model_id)
        if stats is None:
            stats = self._stats[model_id] = _ModelStats()
        return stats
