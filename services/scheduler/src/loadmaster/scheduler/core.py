"""The scheduler's decisions: admission, dispatch, retries, expiry, conflation, clients, cold starts.

`SchedulerCore` is synchronous and owns no I/O. Callers feed it what arrived on the
streams (a gateway batch, a worker hello/report/loss, a session loss, "the timer
fired") and it answers through an `Outbound` sink (grants, rejects, worker commands).
After each call the caller re-arms one timer at `next_deadline()`: the earliest request
deadline, client liveness check or batch release, whichever comes first.

Every admitted request ends exactly once: a Reject, or a Grant whose Complete is
final (success or non-retryable failure). A retryable failure re-queues the
request (same arrival, same deadline) while attempts <= max_retries.

The core lends a model's free slots to the gateways using it as dispatch credits (credits.py,
docs/data-path.md): runs on them are admitted already started, or only counted (RunTally).
Which queued request goes to which worker is decided by its `GrantDispatcher` (dispatching.py).
"""

from __future__ import annotations

import itertools
import logging
import random
from collections import Counter
from collections.abc import Sequence

from loadmaster.common.clock import Clock
from loadmaster.common.ordering import Ordering, make_ordering
from loadmaster.common.ordering.clients import ClientTracker
from loadmaster.scheduler.config import CoreConfig, ModelPolicy
from loadmaster.scheduler.credits import CreditBook
from loadmaster.scheduler.dispatching import GrantDispatcher
from loadmaster.scheduler.domain import (
    Completion,
    Credit,
    FinishedRun,
    OverflowPolicy,
    QueueStats,
    Reject,
    Request,
    RequestInfo,
    RequestKey,
    RunTally,
    SlotStatus,
    Submission,
    WorkerHello,
    WorkerView,
)
from loadmaster.scheduler.loads import LoadTracker
from loadmaster.scheduler.outbound import NoTelemetry, Outbound, Telemetry
from loadmaster.scheduler.queues import RequestQueues
from loadmaster.scheduler.registry import WorkerRegistry, newly_ready
from loadmaster.scheduler.tracking import ModelStats, Outstanding, Tracked, reached_gateway
from loadmaster.v1 import errors_pb2

__all__ = ["CoreConfig", "ModelPolicy", "Outbound", "SchedulerCore", "Telemetry"]

log = logging.getLogger(__name__)

_OK = errors_pb2.ERROR_CODE_UNSPECIFIED
_UNAVAILABLE = errors_pb2.ERROR_CODE_UNAVAILABLE
_CANCELLED = errors_pb2.ERROR_CODE_CANCELLED


class SchedulerCore:
    def __init__(
        self,
        config: CoreConfig,
        *,
        clock: Clock,
        outbound: Outbound,
        ordering: Ordering | None = None,
        telemetry: Telemetry | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._config = config
        self._clock = clock
        self._out = outbound
        self._telemetry: Telemetry = telemetry if telemetry is not None else NoTelemetry()
        self._queues = RequestQueues(ordering if ordering is not None else make_ordering("model_deadline"))
        self._registry = WorkerRegistry()
        self._clients = ClientTracker(
            cadence_alpha=config.cadence_alpha, disconnect_timeout_s=config.disconnect_timeout_s
        )
        self._tracked: dict[RequestKey, Tracked] = {}
        # client -> model -> its admitted requests not ended yet (queued or granted)
        self._outstanding = Outstanding()
        self._stats: dict[str, ModelStats] = {}
        self._loads = LoadTracker()
        self._arrivals = itertools.count()
        self._credits = CreditBook(
            config.credit_window_s,
            registry=self._registry,
            outbound=outbound,
            telemetry=self._telemetry,
            period_s=config.share_period_s,
            central=self._waiting_by_session,
        )
        self._dispatcher = GrantDispatcher(
            config,
            clock=clock,
            outbound=outbound,
            telemetry=self._telemetry,
            queues=self._queues,
            registry=self._registry,
            credits=self._credits,
            loads=self._loads,
            tracked=self._tracked,
            outstanding=self._outstanding,
            stats=self._stats,
            expire=self._expire,
            hand_back=self._hand_back,
            rng=rng if rng is not None else random.Random(),
        )

    # ---- gateway side ------------------------------------------------------------

    def submit(self, session_id: int, batch: Submission) -> None:
        """One batch from a gateway session; dispatches once at the end. Its parts apply
        in the order scheduler.proto gives for a SessionRequest."""
        touched: set[str] = set()
        for completion in batch.completes:  # completions first: they free slots for this batch
            self._complete(session_id, completion, touched)
        for done in batch.finished:  # before returns: a credit's runs end before it is handed back
            self._finished_run(session_id, done, touched)
        for tally in batch.tallies:
            self._tally(session_id, tally)
        for credit_id in batch.returns:
            credit = self._credits.give_back(session_id, credit_id)
            if credit is not None:
                touched.add(credit.model_id)
                for key in credit.running:
                    if (run := self._tracked.get(key)) is not None:
                        run.credit_id = None  # returned mid-run: now an ordinary grant
        for run in batch.runs:
            self._enqueue(session_id, run.info, touched, credit_id=run.credit_id)
        for info in batch.enqueues:
            self._enqueue(session_id, info, touched)
        for request_id in batch.cancels:
            self._cancel((session_id, request_id))
        for model_id, waiting, outstanding_s in batch.local_depths:
            self._credits.note_local_depth(session_id, model_id, waiting, outstanding_s)
            if outstanding_s > 0.0:  # it had calls for the model: it uses it
                self._credits.note_use(model_id, session_id, self._clock.monotonic())
            self._telemetry.record("queue_depth", self._depth(model_id), {"model": model_id})
        self._dispatcher.dispatch(touched)

    def accept_credits(self, session_id: int) -> None:
        """The session's gateway understands dispatch credits."""
        self._credits.accept(session_id)

    def close_session(self, session_id: int) -> None:
        """The gateway is gone: drop its waiting requests silently, free its grants and credits."""
        touched = self._credits.drop_session(session_id)
        for key, tracked in list(self._tracked.items()):
            if key[0] != session_id:
                continue
            self._forget(tracked.request)
            if tracked.worker_id is None:
                self._queues.remove(key)
            else:
                self._registry.release(tracked.worker_id, key)
                touched.add(tracked.request.model_id)
        self._dispatcher.dispatch(touched)

    # ---- worker side -------------------------------------------------------------

    def add_worker(self, hello: WorkerHello) -> None:
        """A worker said hello; one that reconnects under the same id replaces the old one."""
        if self._registry.get(hello.worker_id) is not None:
            self.remove_worker(hello.worker_id)
        self._registry.add(hello)
        self._dispatcher.dispatch(self._queues.waiting_models())

    def update_worker(self, worker_id: str, slots: Sequence[SlotStatus], *, free_mb: int = 0) -> None:
        """A worker's full slot report (`free_mb` 0 = not reported)."""
        if self._registry.get(worker_id) is None:
            return
        previous = self._registry.report(worker_id, slots, free_mb=free_mb)
        self._credits.revoke_stale(worker_id, slots)
        failures = self._dispatcher.load_outcomes(worker_id, previous, {s.model_id: s for s in slots})
        for model_id, error in failures.items():
            log.warning("model %s failed to load on worker %s: %s", model_id, worker_id, error)
            self._reject_waiters(model_id, f"model {model_id!r} failed to load on {worker_id}: {error}")
        self._dispatcher.dispatch({*self._queues.waiting_models(), *newly_ready(previous, slots)})

    def remove_worker(self, worker_id: str) -> None:
        """A worker's stream ended: re-queue (or reject) what it was granted, load elsewhere."""
        record = self._registry.remove(worker_id)
        if record is None:
            return
        self._loads.forget_worker(worker_id)
        touched: set[str] = set()
        for key in [*record.granted, *self._credits.drop_worker(worker_id)]:
            tracked = self._tracked.get(key)
            if tracked is not None and tracked.worker_id == worker_id:
                tracked.worker_id = None
                tracked.credit_id = None
                self._retry_or_reject(tracked, _UNAVAILABLE, f"worker {worker_id} disconnected", touched)
        self._dispatcher.dispatch(set(self._queues.waiting_models()) | touched)

    # ---- time --------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When the core next has time-driven work: the earliest waiting request's deadline,
        client liveness check or batch release (clock.monotonic scale)."""
        now = self._clock.monotonic()
        times = (
            self._queues.next_deadline(),
            self._clients.next_check(),
            self._loads.next_retry(),  # a load behind the VRAM gate tries again
            self._dispatcher.next_batch_release(now),
            self._credits.next_rebalance(),  # shares split between gateways
        )
        return min((t for t in times if t is not None), default=None)

    def expire_due(self) -> None:
        """The timer fired: expire due requests, mark silent clients, release due batches."""
        now = self._clock.monotonic()
        for request in self._queues.pop_expired(now):
            self._expire(request)
        for client_id in self._clients.due_disconnects(now):
            self._disconnect_client(client_id)
        if self._queues.ordering.batch is not None:  # due batches
            self._dispatcher.dispatch(self._queues.waiting_models())
        elif self._loads.gating:
            self._dispatcher.dispatch(self._loads.due(now))  # loads behind the VRAM gate
        if (due := self._credits.next_rebalance()) is not None and due <= now:
            self._dispatcher.dispatch(self._credits.rebalance(now))

    # ---- admin -------------------------------------------------------------------

    @property
    def strategy(self) -> str:
        return self._queues.ordering.name

    @property
    def ordering(self) -> Ordering:
        return self._queues.ordering

    @property
    def active_clients(self) -> int:
        return self._clients.active

    def set_ordering(self, ordering: Ordering) -> int:
        """Switch strategy: every waiting request moves to the new queues (none is lost).
        Returns how many moved."""
        moved = len(self._queues)
        self._queues = self._dispatcher.queues = self._queues.reordered(ordering)
        # Gateways rank their local queues by the strategy their credits carry, and batch groups
        # are formed centrally: take every credit back (re-lent with the new strategy).
        self._credits.revoke_all()
        log.info("strategy switched to %s; %d waiting requests moved", ordering.name, moved)
        self._telemetry.record("strategy_switches", 1, {"strategy": ordering.name})
        self._dispatcher.dispatch(self._queues.waiting_models())
        return moved

    def workers(self) -> list[WorkerView]:
        return [
            WorkerView(record.hello, tuple(record.slots.values()))
            for record in sorted(self._registry, key=lambda r: r.worker_id)
        ]

    def queue_stats(self) -> list[QueueStats]:
        return [
            QueueStats(
                model_id=model_id,
                depth=self._depth(model_id),
                inflight=self._registry.inflight(model_id) - (idle := self._credits.idle(model_id)),
                expired=stats.expired,
                overflowed=stats.overflowed,
                granted=stats.granted,
                superseded=stats.superseded,
                dropped=stats.dropped,
                credits=idle,
            )
            for model_id, stats in sorted(self._stats.items())
        ]

    def _hand_back(self, request: Request) -> None:
        """A waiting request whose gateway now holds a share of its model: it queues there."""
        self._queues.remove(request.key)
        self._forget(request)
        self._out.reject(
            request.key[0], Reject(request.info.request_id, _UNAVAILABLE, "queue it locally", True)
        )

    def _waiting_by_session(self, model_id: str) -> Counter[int]:
        """How many of the model's requests wait here, per gateway session."""
        return Counter(r.key[0] for r in self._queues.of_model(model_id))

    def _depth(self, model_id: str) -> int:
        """Requests waiting for the model: here, and in its gateways' local queues."""
        return self._queues.depth(model_id) + self._credits.local_depth(model_id)

    # ---- admission ---------------------------------------------------------------

    def _enqueue(
        self, session_id: int, info: RequestInfo, touched: set[str], *, credit_id: str | None = None
    ) -> None:
        """Admit a request to its model's queue, or, with `credit_id`, as already running
        on that credit's slot (a credit no longer valid: queued like any other request; the
        gateway then follows the grant)."""
        key = (session_id, info.request_id)
        model_id = info.model_id
        if not info.request_id:
            log.warning("session %d enqueued a request without request_id; ignored", session_id)
            return
        if not model_id:
            self._reject_key(key, errors_pb2.ERROR_CODE_INVALID_ARGUMENT, "model_id is required")
            return
        if key in self._tracked:
            log.warning(
                "duplicate request id in session %d", session_id, extra={"request_id": info.request_id}
            )
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
        policy = self._config.policy(model_id)
        now = self._clock.monotonic()
        client_id = info.client_id
        budget_ms = self._config.latency_budget_ms(client_id)
        cadence_ms: float | None = None
        backlog = 0
        if client_id:
            arrived = now if credit_id is None else reached_gateway(info, now, self._clock.time())
            # A front end that holds its client's connection (HTTP, gRPC, the OpenAI API:
            # `connection_bound`) cancels what a gone client left, and such a client waits for
            # its answer instead of sending at a cadence: a request queued behind a cold load
            # or the VRAM gate is not silence. Only edge clients are tracked.
            if not info.connection_bound:
                if self._clients.observe(client_id, arrived):
                    self._telemetry.record("active_clients", self._clients.active)
                cadence_ms = self._clients.cadence_ms(client_id)
            if policy.latest_only:
                self._supersede(client_id, model_id)
            backlog = len(self._outstanding.keys(client_id, model_id))
        if policy.dispatch_credits:
            self._credits.note_use(model_id, session_id, now)
        ttl_ms = policy.request_ttl_ms
        if 0 < info.timeout_ms < ttl_ms:
            ttl_ms = info.timeout_ms
        ttl_s = ttl_ms / 1000.0
        if credit_id is None and (slow := self._dispatcher.load_outlasts(model_id, ttl_ms, now)) is not None:
            self._stats_for(model_id).expired += 1
            self._telemetry.record("requests_expired", 1, {"model": model_id})
            self._telemetry.record("requests_dropped", 1, {"model": model_id, "reason": "expired"})
            self._reject_key(key, errors_pb2.ERROR_CODE_EXPIRED, slow)
            return
        # Positional, in Request's field order: a class called with keywords packs them into
        # a dict first, which doubles the cost of this call (once per request).
        request = Request(
            key,
            info,
            next(self._arrivals),  # arrival
            now,  # enqueued_at
            now + ttl_s,  # deadline
            int((self._clock.time() + ttl_s) * 1e9),  # deadline_unix_ns
            budget_ms,
            cadence_ms,
            backlog,
        )
        stats = self._stats_for(model_id)
        if credit_id is not None:
            credit = self._credits.get(credit_id)
            if credit is not None and credit.session_id == session_id and credit.model_id == model_id:
                self._start_on_credit(request, credit, now)
                return
        if self._queues.depth(model_id) >= policy.max_queue_size:
            stats.overflowed += 1
            self._telemetry.record("queue_full_drops", 1, {"model": model_id})
            self._telemetry.record("requests_dropped", 1, {"model": model_id, "reason": "overflow"})
            full = f"queue for model {model_id!r} is full ({policy.max_queue_size} waiting)"
            if policy.overflow_policy is OverflowPolicy.REJECT_NEWEST:
                self._reject_key(key, errors_pb2.ERROR_CODE_OVERFLOW, full)
                return
            oldest = self._queues.pop_oldest(model_id)
            if oldest is not None:
                self._forget(oldest)
                self._reject_key(oldest.key, errors_pb2.ERROR_CODE_OVERFLOW, f"{full}; dropped the oldest")
        if self._credits.holds_share(session_id, model_id):
            # Sent before its gateway got the model's whole share: it queues there (else it
            # would wait here for a slot lent to that same gateway, and take its share back).
            self._out.reject(session_id, Reject(info.request_id, _UNAVAILABLE, "queue it locally", True))
            return
        self._tracked[key] = Tracked(request)
        if client_id:
            self._outstanding.add(client_id, model_id, key)
        self._queues.push(request)
        touched.add(model_id)

    def _supersede(self, client_id: str, model_id: str) -> None:
        """latest_only: the client's queued (not granted) requests for the model give way.

        Requests that arrived in the same gateway batch get their chance at a free worker
        first: a batch on the stream must not change what a one-by-one arrival would do."""
        keys = self._outstanding.keys(client_id, model_id)
        if not keys:
            return
        if any(key in self._queues for key in keys):
            self._dispatcher.dispatch([model_id])
        for key in list(self._outstanding.keys(client_id, model_id)):
            request = self._queues.remove(key)
            if request is None:
                continue  # granted: it runs
            self._forget(request)
            self._stats_for(model_id).superseded += 1
            self._telemetry.record("requests_dropped", 1, {"model": model_id, "reason": "superseded"})
            self._reject_key(
                key,
                errors_pb2.ERROR_CODE_SUPERSEDED,
                f"superseded by a newer request from client {client_id!r} for model {model_id!r}",
            )

    def _disconnect_client(self, client_id: str) -> None:
        """A client silent past disconnect_timeout_s: drop its queued requests, with a reply."""
        log.info("client %s disconnected (silent for %.1f s)", client_id, self._config.disconnect_timeout_s)
        self._telemetry.record("client_disconnected", 1)
        self._queues.ordering.forget_client(client_id)
        self._telemetry.record("active_clients", self._clients.active)
        queued = [
            request
            for key in self._outstanding.of_client(client_id)
            if (request := self._queues.get(key)) is not None
        ]
        for request in sorted(queued, key=lambda r: r.arrival):  # answered in arrival order
            key, model_id = request.key, request.model_id
            self._queues.remove(key)
            self._forget(request)
            self._stats_for(model_id).dropped += 1
            self._telemetry.record(
                "requests_dropped", 1, {"model": model_id, "reason": "client_disconnected"}
            )
            self._reject_key(
                key,
                _CANCELLED,
                f"client {client_id!r} disconnected (silent for "
                f"{self._config.disconnect_timeout_s:g} s); its queued request was dropped",
            )

    def _forget(self, request: Request) -> None:
        """`request` has ended (or its gateway is gone): stop tracking it."""
        key = request.key
        self._tracked.pop(key, None)
        client_id = request.info.client_id
        if client_id:
            self._outstanding.discard(client_id, request.model_id, key)

    # ---- completion --------------------------------------------------------------

    def _complete(self, session_id: int, completion: Completion, touched: set[str]) -> None:
        key = (session_id, completion.request_id)
        tracked = self._tracked.get(key)
        if tracked is None or tracked.worker_id is None:
            return  # unknown, or a late report for an attempt already re-queued
        if completion.worker_id and completion.worker_id != tracked.worker_id:
            return  # a late reply from an earlier attempt's worker
        if tracked.credit_id is not None:
            credit = self._credits.get(tracked.credit_id)
            if credit is not None:
                credit.running.discard(key)  # the slot stays lent until the gateway returns it
            tracked.credit_id = None
        else:
            self._registry.release(tracked.worker_id, key)
        tracked.worker_id = None
        touched.add(tracked.request.model_id)
        if completion.error_code == _OK or not completion.retryable:
            self._forget(tracked.request)
            return
        reason = errors_pb2.ErrorCode.Name(completion.error_code).removeprefix("ERROR_CODE_").lower()
        self._retry_or_reject(tracked, completion.error_code, reason, touched)

    def _cancel(self, key: RequestKey) -> None:
        tracked = self._tracked.get(key)
        if tracked is not None and tracked.worker_id is None:
            self._forget(tracked.request)
            self._queues.remove(key)

    def _retry_or_reject(self, tracked: Tracked, error_code: int, reason: str, touched: set[str]) -> None:
        """A granted attempt failed retryably: queue it again, or give the final answer."""
        request = tracked.request
        retries_left = tracked.attempts <= self._config.max_retries
        in_time = request.deadline > self._clock.monotonic()
        if retries_left and in_time:
            self._queues.push(request)  # over max_queue_size if need be: it was admitted already
            self._telemetry.record("request_retries", 1, {"model": request.model_id})
            touched.add(request.model_id)
            return
        self._forget(request)
        attempts = "attempt" if tracked.attempts == 1 else "attempts"
        message = f"request failed after {tracked.attempts} {attempts}: {reason}"
        if retries_left:
            message += " (no time left to retry)"
        self._reject_key(request.key, error_code, message)

    # ---- dispatch credits ----------------------------------------------------------

    def _finished_run(self, session_id: int, done: FinishedRun, touched: set[str]) -> None:
        """A credit run and its outcome at once: admitted as run on the credit, then completed.
        If the credit is gone, an answered call needs nothing more, and one that failed
        retryably is admitted like a new request (its gateway queues it, or follows its grant)."""
        run, completion = done.run, done.completion
        credit = self._credits.get(run.credit_id)
        retry = completion.error_code != _OK and completion.retryable
        if (credit is None or credit.session_id != session_id) and not retry:
            return
        self._enqueue(session_id, run.info, touched, credit_id=run.credit_id)
        tracked = self._tracked.get((session_id, run.info.request_id))
        if tracked is not None and tracked.worker_id is not None:
            self._complete(session_id, completion, touched)

    def _tally(self, session_id: int, tally: RunTally) -> None:
        """Credit runs that ended before they were reported, counted: what a FinishedRun each
        would have left behind (statistics, the session's use of the model), without admitting
        each one (docs/data-path.md)."""
        model_id = tally.model_id
        self._stats_for(model_id).granted += tally.runs
        self._telemetry.record(
            "placement_decisions",
            tally.runs,
            {"model": model_id, "worker": tally.worker_id, "kind": "credit"},
        )
        if self._config.policy(model_id).dispatch_credits:
            self._credits.note_use(model_id, session_id, self._clock.monotonic())

    def _start_on_credit(self, request: Request, credit: Credit, now: float) -> None:
        """Admit a request the gateway already sent to `credit`'s worker."""
        key = request.key
        credit.running.add(key)
        model_id = request.model_id
        self._tracked[key] = Tracked(
            request, attempts=1, worker_id=credit.worker_id, credit_id=credit.credit_id
        )
        client_id = request.info.client_id
        if client_id:
            self._outstanding.add(client_id, model_id, key)
        self._stats_for(model_id).granted += 1
        self._telemetry.record("scheduling_wait_ms", 0.0, {"model": model_id})
        self._telemetry.record(
            "placement_decisions", 1, {"model": model_id, "worker": credit.worker_id, "kind": "credit"}
        )

    def _reject_waiters(self, model_id: str, message: str) -> None:
        while (request := self._queues.pop(model_id)) is not None:
            self._forget(request)
            self._reject_key(request.key, _UNAVAILABLE, message)

    def _expire(self, request: Request) -> None:
        self._forget(request)
        model_id = request.model_id
        self._stats_for(model_id).expired += 1
        self._telemetry.record("requests_expired", 1, {"model": model_id})
        self._telemetry.record("requests_dropped", 1, {"model": model_id, "reason": "expired"})
        now = self._clock.monotonic()
        waited_ms = (now - request.enqueued_at) * 1000.0
        self._reject_key(
            request.key,
            errors_pb2.ERROR_CODE_EXPIRED,
            f"expired after waiting {waited_ms:.0f} ms for model {model_id!r}"
            f"{self._dispatcher.waiting_for(model_id, now)}",
        )

    def _reject_key(self, key: RequestKey, error_code: int, message: str) -> None:
        self._out.reject(key[0], Reject(request_id=key[1], error_code=error_code, message=message))

    def _stats_for(self, model_id: str) -> ModelStats:
        stats = self._stats.get(model_id)
        if stats is None:
            stats = self._stats[model_id] = ModelStats()
        return stats
