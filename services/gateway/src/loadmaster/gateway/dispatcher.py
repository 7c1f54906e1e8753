"""The one dispatcher behind every front end (edge ZMQ, KServe v2 gRPC and HTTP).

A call's path: `submit` registers it and enqueues its metadata with the
scheduler; a Grant sends descriptors + payload to the granted worker's data
port; the worker's reply (or a Reject, or the reply watchdog) finishes the call
exactly once through its callback, and the scheduler is told with Complete.
A retryable worker failure is not answered: the scheduler re-grants (possibly
elsewhere) or rejects. Replies from an earlier grant's worker are ignored.

Dispatch credits (scheduler.proto) skip the grant round trip: while the gateway
holds an idle credit for a call's model, `submit` sends the call straight to the
credit's worker and reports it to the scheduler as already running. A credit is
idle again once its call has ended, unless it was revoked (then it is returned)
or its worker failed the call retryably or never replied (returned as well).

Reports of calls run on a credit may wait a few milliseconds: see `SchedulerLink`.

While the gateway holds a model's whole share, a call that finds no idle credit waits here
(`LocalShare`) for the next credit that frees, with no scheduler round trip (docs/data-path.md).

A worker that goes away (its data link is lost: the process died, ZMTP heartbeats found it
silent, or a new link never connected; `WorkerLinks`) fails the calls it held as
`unavailable`. When the scheduler session that knows them is up, it hears of the worker's
end on its own stream and re-grants them (a retry reported before then could be granted to
the dead worker again and spend the last attempt there), so they get `lost_grace_s` for
that (timed on its own, not at the watchdog's next round), then go to it as retryable
failures. With no such session (a new session never heard of them) they are answered at
once. docs/liveness.md has the times. A worker that never replies is caught by the reply
watchdog: `expired` at the deadline + `reply_grace_s`.

A large payload for a worker on this host travels in a shared memory slot (see
`ShmPayloads`). The slot belongs to one send: it is freed when that worker's reply
arrives and quarantined when the send ends otherwise (watchdog, cancel, another grant),
because the worker may still be reading it.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from loadmaster.common import internal_auth, tracing
from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.errors import (
    ExpiredError,
    LoadmasterError,
    UnavailableError,
    edge_code_name,
    error_for_code,
)
from loadmaster.common.liveness import LIVENESS
from loadmaster.common.ordering import SortKey
from loadmaster.common.shm import ShmSlot
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.gateway.calls import CallResult, InferenceCall, ResultCallback, request_info
from loadmaster.gateway.drain import Drain, shutting_down
from loadmaster.gateway.held_credits import HeldCredit, HeldCredits
from loadmaster.gateway.local_share import LocalShare
from loadmaster.gateway.ports import SchedulerPort, WorkerPort
from loadmaster.gateway.worker_link import ShmPayloads
from loadmaster.v1 import errors_pb2, model_pool_pb2, scheduler_pb2

__all__ = ["Dispatcher", "SchedulerPort", "WorkerPort"]

log = logging.getLogger(__name__)

_NOT_FOUND = edge_code_name(errors_pb2.ERROR_CODE_NOT_FOUND)
_WATCH_INTERVAL_S = 0.25  # how often the reply watchdog looks for overdue calls
_MAX_HAND_BACKS = 3  # a call the scheduler hands back more often is answered `unavailable`


@dataclass(slots=True)
class _Pending:
    call: InferenceCall
    on_result: ResultCallback
    worker_id: str = ""
    attempt: int = 0
    span: trace.Span = trace.INVALID_SPAN  # recording only while tracing is on
    credit: HeldCredit | None = None  # the dispatch credit it runs on
    endpoint: str = ""  # the data endpoint of worker_id
    shm: ShmSlot | None = None  # the payload's shared memory slot while a worker may read it
    session: int = 0  # the scheduler session that knows the call
    reply_deadline: float = 0.0  # clock.monotonic() by which its worker must reply (0: none)
    lost: bool = False  # its worker's data link dropped: the watchdog fails it retryably
    sent_at: float = 0.0  # clock.monotonic() when it went to its worker
    handed_back: int = 0  # times the scheduler sent it back to this gateway's share


class Dispatcher:
    """Its links call back into it, so it builds them: `scheduler(self)` and `workers(self)`
    return the scheduler session and the worker data links, wired to its callbacks
    (`on_grant` ... `on_scheduler_lost`; `on_worker_reply`, `on_worker_lost`)."""

    def __init__(
        self,
        *,
        scheduler: Callable[[Dispatcher], SchedulerPort],
        workers: Callable[[Dispatcher], WorkerPort],
        telemetry: TelemetryReporter,
        shm: ShmPayloads | None = None,
        clock: Clock | None = None,
        reply_grace_s: float = 10.0,
        lost_grace_s: float = LIVENESS.lost_grace_s,
    ) -> None:
        self._telemetry = telemetry
        self._clock: Clock = clock or SystemClock()
        self._reply_grace_s = reply_grace_s
        self._lost_grace_s = lost_grace_s
        self._shm = shm
        self._pending: dict[str, _Pending] = {}
        self._credits = HeldCredits(self._clock)
        # (reply deadline, request id, attempt) of calls on workers; stale entries are skipped
        self._reply_deadlines: list[tuple[float, str, int]] = []
        self._watchdog: asyncio.Task[None] | None = None
        self._lost_timers: set[asyncio.Task[None]] = set()  # lost workers' calls' grace
        self._drain = Drain()
        self._scheduler = scheduler(self)
        self._workers = workers(self)
        # Calls waiting for a credit of a model whose whole share this gateway holds.
        self._local: LocalShare[_Pending] = LocalShare(
            clock=self._clock,
            scheduler=self._scheduler,
            credits=self._credits,
            take=self._idle_credit,
            start=self._start_on_credit,
            to_scheduler=self._to_scheduler,
            fail=lambda pending, error: self._finish(pending, self._failed(pending.call, error)),
        )

    @property
    def inflight(self) -> int:
        return len(self._pending)

    def shares(self) -> dict[str, dict[str, int]]:
        """Per model: the dispatch credits held (not revoked) and the calls in the local queue."""
        return {
            m: {"credits": n, "waiting": self._local.waiting(m)} for m, n in self._credits.counts().items()
        }

    def start(self) -> None:
        """Start the reply watchdog (on the running loop)."""
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch(), name="reply-watchdog")

    async def drain(self, timeout_s: float) -> int:
        """Refuse new calls (`unavailable`) from now on and wait, at most `timeout_s` (real
        time: the process is stopping), for the calls in flight to be answered. Returns how
        many are still in flight."""
        return await self._drain.wait(self._pending, timeout_s)

    def describe_inflight(self, most: int = 5) -> list[str]:
        """The first `most` calls in flight and where each waits, for a log line."""
        described = []
        for pending in itertools.islice(self._pending.values(), most):
            call = pending.call
            if pending.worker_id:
                where = f"on worker {pending.worker_id}" + (" (its link lost)" if pending.lost else "")
            elif call.request_id in self._local:
                where = "in the local queue"
            else:
                where = "waiting for the scheduler"
            described.append(f"{call.request_id} ({call.model_id}, {where})")
        return described

    def _forget(self, request_id: str) -> _Pending | None:
        pending = self._pending.pop(request_id, None)
        self._drain.left(self._pending)
        return pending

    async def close(self) -> None:
        self._local.close()
        for timer in list(self._lost_timers):
            timer.cancel()
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
            self._watchdog = None

    # -- front-end API ------------------------------------------------------------------

    def submit(self, call: InferenceCall, on_result: ResultCallback) -> None:
        """Start `call`; `on_result` is called exactly once with its outcome."""
        if self._drain.begun:
            on_result(self._failed(call, shutting_down()))
            return
        if (
            not self._scheduler.connected
            and not self._credits.has_idle(call.model_id)
            and not self._local.accepts(call.model_id)
        ):
            on_result(self._failed(call, UnavailableError("scheduler unreachable; try again shortly")))
            return
        if call.request_id in self._pending:
            on_result(self._failed(call, UnavailableError(f"duplicate request id {call.request_id}")))
            return
        span = tracing.start_request_span(
            "gateway.request", request_id=call.request_id, model_id=call.model_id, kind=SpanKind.SERVER
        )
        pending = self._pending[call.request_id] = _Pending(
            call, on_result, span=span, session=self._scheduler.session
        )
        credit = self._idle_credit(call.model_id)
        if credit is not None and self._local.holds(call):  # kept free for a more urgent client
            self._credits.idle_again(credit)
            credit = None
        if credit is not None and self._start_on_credit(pending, credit):
            self._local.started(call)  # (the local order's clients and rounds see every call)
            return
        if self._local.may_queue(call.model_id):
            self._local.queue(pending)
        else:
            self._to_scheduler(pending)

    def _start_on_credit(
        self, pending: _Pending, credit: HeldCredit, key: SortKey | None = None, front: bool = False
    ) -> bool:
        """Send the call on a credit (the worker first; see `LocalShare.serve` for `key` and
        `front`) and report the run to the scheduler that lent it, if that one still serves;
        False if the worker was unreachable."""
        if not self._run_on_credit(pending, credit, key, front):
            return False
        pending.session = credit.session
        scheduler = self._scheduler
        if scheduler.connected and credit.session == scheduler.session:
            credit_id = credit.credit_id
            scheduler.report_run(
                pending.call.request_id,
                pending.call.model_id,
                lambda: request_info(pending.call, credit_id, pending.span),
            )
        # else: run on a lost scheduler's share; this session's scheduler never hears of it
        return True

    def _to_scheduler(self, pending: _Pending) -> None:
        """Queue the call with the scheduler (answered `unavailable` while none is connected)."""
        if not self._scheduler.connected:
            self._finish(
                pending,
                self._failed(pending.call, UnavailableError("scheduler unreachable; try again shortly")),
            )
            return
        pending.session = self._scheduler.session
        self._scheduler.enqueue(request_info(pending.call, "", pending.span))

    def _requeue_on_share(self, pending: _Pending) -> None:
        """A call the scheduler handed back: run it on an idle credit, or queue it locally (or,
        if the share went meanwhile, queue it with the scheduler again)."""
        model_id = pending.call.model_id
        credit = self._idle_credit(model_id)
        if credit is not None and self._start_on_credit(pending, credit):
            return
        if self._local.may_queue(model_id):
            self._local.queue(pending)
        else:
            self._to_scheduler(pending)

    def cancel(self, request_id: str) -> None:
        """The caller went away: drop its queued request; no reply is sent."""
        pending = self._forget(request_id)
        if pending is None:
            return
        if self._local.remove(request_id) is not None:  # the scheduler never heard of it
            tracing.end_span(pending.span, error_code="cancelled")
            return
        self._disarm(pending)
        self._drop_shm(pending, answered=False)
        tracing.end_span(pending.span, error_code="cancelled")
        if pending.worker_id:
            self._scheduler.complete(request_id, error_code=errors_pb2.ERROR_CODE_CANCELLED)
        else:
            self._scheduler.cancel(request_id)
        self._release_credit(pending)

    # -- scheduler callbacks -------------------------------------------------------------

    def heard_from_scheduler(self) -> None:
        """The session granted something: credits of an earlier session stop counting."""
        self._credits.heard(self._scheduler.session)

    def on_grant(self, grant: scheduler_pb2.Grant) -> None:
        self.heard_from_scheduler()
        pending = self._pending.get(grant.request_id)
        if pending is None:  # cancelled or answered meanwhile: give the slot back
            self._scheduler.complete(grant.request_id, error_code=errors_pb2.ERROR_CODE_CANCELLED)
            return
        # A run the scheduler did not take as one (its credit was gone) was queued and
        # granted like any other request: follow the grant.
        self._release_credit(pending, give_back=True)
        pending.attempt = grant.attempt
        try:
            self._send(
                pending,
                grant.worker_id,
                grant.data_endpoint,
                grant.generation,
                grant.deadline_unix_ns,
            )
        except UnavailableError as error:
            self._scheduler.complete(
                pending.call.request_id, error_code=error.code, retryable=True, worker_id=grant.worker_id
            )

    def on_reject(self, reject: scheduler_pb2.Reject) -> None:
        pending = self._pending.get(reject.request_id)
        if pending is None:
            return
        if reject.use_share:  # sent before this gateway got the model's whole share
            if pending.worker_id or pending.call.request_id in self._local:
                return
            pending.handed_back += 1
            if pending.handed_back <= _MAX_HAND_BACKS:
                self._requeue_on_share(pending)
                return
            # The scheduler counts a share here this gateway does not hold: answer, not loop.
            message = f"the scheduler and this gateway disagree on the slots of {pending.call.model_id!r}"
            log.error("call %s: %s", reject.request_id, message)
        else:
            message = reject.message
        self._finish(pending, self._failed(pending.call, error_for_code(reject.error_code, message)))
        self._release_credit(pending)

    def on_credit(self, credit: scheduler_pb2.Credit) -> None:
        lent = self._credits.add(credit, self._scheduler.session)
        self._local.configure(lent.model_id, credit.local_queue, lent.request_ttl_ms)
        self._local.serve(lent.model_id)

    def on_revoke(self, credit_id: str) -> None:
        credit = self._credits.revoke(credit_id)
        if credit is None:
            return
        if not credit.calls:  # else returned when its last call ends
            self._give_back(credit)
        self._local.hand_over(credit.model_id)

    def on_scheduler_lost(self) -> None:
        """Calls still waiting for a grant will never get one: answer them now. The lost
        session's credits stay usable while no scheduler serves (the scheduler is away, its
        workers may not be: docs/deploy.md, "Scheduler failover"), until the next session first
        grants or lends something; then they are dropped unreturned, since its scheduler
        (perhaps a standby that took over) never lent them."""
        local = self._local
        waiting = [p for p in self._pending.values() if not p.worker_id and p.call.request_id not in local]
        for pending in waiting:
            self._finish(pending, self._failed(pending.call, UnavailableError("scheduler connection lost")))

    # -- worker callback -----------------------------------------------------------------

    def on_worker_reply(self, reply: model_pool_pb2.InferResponse, payload: Any) -> None:
        pending = self._pending.get(reply.request_id)
        if pending is None or reply.worker_id != pending.worker_id:
            return  # a late reply to an earlier grant, or to a call already answered
        self._drop_shm(pending, answered=True)
        code = reply.error_code
        if reply.shm_unusable and self._shm is not None:
            self._shm.refuse(pending.endpoint, reply.error_message)
        if code and reply.retryable:
            self._worker_failed(pending, error_for_code(code, reply.error_message))
            return
        if code:
            result = self._failed(pending.call, error_for_code(code, reply.error_message))
        else:
            result = CallResult(
                request_id=reply.request_id,
                model_id=pending.call.model_id,
                outputs=reply.outputs,
                payload=payload,
                inference_latency_ms=reply.inference_latency_ms,
                worker_id=reply.worker_id,
            )
        if not code and pending.credit is not None:
            inference_ms = reply.inference_latency_ms
            path_ms = (self._clock.monotonic() - pending.sent_at) * 1e3 - inference_ms - reply.queue_ms
            self._local.served(pending.call.model_id, inference_ms, path_ms)
        self._finish(pending, result)
        self._scheduler.complete(
            reply.request_id,
            error_code=code,
            worker_id=reply.worker_id,
            inference_ms=reply.inference_latency_ms,
            deferred=pending.credit is not None and not pending.credit.revoked,
        )
        self._release_credit(pending)

    def on_worker_lost(self, endpoint: str) -> None:
        """The data link to `endpoint` disconnected: its worker will not answer what it holds."""
        lost = [p for p in self._pending.values() if p.worker_id and p.endpoint == endpoint]
        if lost:
            log.warning("worker data port %s went away with %d requests in flight", endpoint, len(lost))
        scheduler = self._scheduler
        waiting = False
        for pending in lost:
            if scheduler.connected and scheduler.session == pending.session:
                pending.lost = True  # the scheduler re-grants it meanwhile, or the watchdog fails it
                self._arm_at(pending, self._clock.monotonic() + self._lost_grace_s)
                waiting = True
            else:
                self._worker_failed(pending, self._lost_error(pending))
        if waiting:
            timer = asyncio.get_running_loop().create_task(self._expire_after(self._lost_grace_s))
            self._lost_timers.add(timer)
            timer.add_done_callback(self._lost_timers.discard)

    async def _expire_after(self, delay_s: float) -> None:
        """The watchdog's round, run `delay_s` from now (its own rounds are 0.25 s apart)."""
        await self._clock.sleep(delay_s)
        try:
            self._expire_overdue()
        except Exception:
            log.exception("expiring a lost worker's calls failed")

    # -- internals -----------------------------------------------------------------------

    @staticmethod
    def _lost_error(pending: _Pending) -> UnavailableError:
        return UnavailableError(f"worker {pending.worker_id} went away while running the request")

    def _worker_failed(self, pending: _Pending, error: LoadmasterError) -> None:
        """The call's worker failed it retryably: the scheduler that knows the call queues it
        again or answers it; with no such scheduler the caller is answered now."""
        worker_id = pending.worker_id
        self._disarm(pending)
        self._drop_shm(pending, answered=False)  # (a reply freed its slot before)
        pending.worker_id = ""
        scheduler = self._scheduler
        if not scheduler.connected or scheduler.session != pending.session:
            self._finish(pending, self._failed(pending.call, error))
            self._release_credit(pending, give_back=True)
            return
        self._telemetry.record("dispatch_retries", 1, {"model": pending.call.model_id})
        scheduler.complete(
            pending.call.request_id, error_code=error.code, retryable=True, worker_id=worker_id
        )
        self._release_credit(pending, give_back=True)

    def _send(
        self,
        pending: _Pending,
        worker_id: str,
        endpoint: str,
        generation: int,
        deadline_ns: int,
        *,
        front: bool = False,
    ) -> None:
        """Send the call to a worker's data port and arm its reply watchdog; on
        `UnavailableError` the call is back to waiting (the caller tells the scheduler)."""
        call = pending.call
        request = model_pool_pb2.InferRequest(
            request_id=call.request_id,
            model_id=call.model_id,
            inputs=call.inputs,
            metadata=call.metadata,
            deadline_unix_ns=deadline_ns,
            generation=generation,
            front_of_queue=front,
        )
        if pending.span.is_recording():
            tracing.inject(request.metadata, span=pending.span)
        if (credentials := internal_auth.current()) is not None:
            credentials.sign_envelope(request.metadata, call.request_id)
        self._drop_shm(pending, answered=False)  # an earlier grant's worker may still read it
        payload, slot = call.payload, None
        if self._shm is not None and (slot := self._shm.place(endpoint, payload)) is not None:
            request.shm.region = self._shm.region
            request.shm.offset = slot.offset
            request.shm.size = slot.size
            payload = b""
            self._telemetry.record("shm_payloads", 1, {"model": call.model_id})
        pending.worker_id = worker_id
        pending.endpoint = endpoint
        pending.shm = slot
        pending.lost = False
        pending.sent_at = self._clock.monotonic()
        try:
            self._workers.send(endpoint, request.SerializeToString(), payload)
        except UnavailableError as error:
            log.warning(
                "sending to worker %s failed: %s",
                worker_id,
                error.message,
                extra={"request_id": call.request_id, "model": call.model_id, "client": call.client_id},
            )
            self._telemetry.record("dispatch_errors", 1, {"model": call.model_id, "code": error.edge_code})
            pending.worker_id = ""
            self._drop_shm(pending, answered=True)  # never sent: no worker reads it
            raise
        self._arm(pending, deadline_ns)

    def _run_on_credit(self, pending: _Pending, credit: HeldCredit, key: SortKey | None, front: bool) -> bool:
        """Send the call on a credit; False (credit returned) if its worker is unreachable."""
        call = pending.call
        ttl_ms = credit.request_ttl_ms
        if call.timeout_ms > 0:
            ttl_ms = min(ttl_ms, call.timeout_ms)
        pending.attempt = 1
        try:
            self._send(
                pending,
                credit.worker_id,
                credit.data_endpoint,
                credit.generation,
                int((self._clock.time() + ttl_ms / 1e3) * 1e9),
                front=front,
            )
        except UnavailableError:
            credit.revoked = True  # (its other calls, if any, end the same way)
            if not credit.calls:
                self._give_back(credit)
            self._local.hand_over(credit.model_id)
            return False
        credit.sent(call.request_id, self._clock.monotonic(), key, front=front)
        pending.credit = credit
        self._local.running(credit.model_id, 1)
        return True

    def _drop_shm(self, pending: _Pending, *, answered: bool) -> None:
        """Give back the call's shared memory slot: freed once its worker `answered`, else quarantined."""
        slot = pending.shm
        if slot is None or self._shm is None:
            return
        pending.shm = None
        if answered:
            self._shm.free(slot)
        else:
            self._shm.quarantine(slot)

    def _release_credit(self, pending: _Pending, *, give_back: bool = False) -> None:
        """The call on `pending`'s credit has ended: the credit takes the next call, or, once its
        last call has ended, is idle again, or returned when it was revoked or `give_back` (its
        worker failed the call: it takes no more)."""
        credit = pending.credit
        if credit is None:
            return
        pending.credit = None
        credit.ended(pending.call.request_id, self._clock.monotonic())
        model_id = credit.model_id
        self._local.running(model_id, -1)
        self._local.ended(pending.call)
        credit.revoked |= give_back
        if credit.calls:
            if not credit.revoked and self._local.waiting(model_id):
                self._local.serve(model_id)  # room to stage one more behind
        elif credit.revoked:
            self._give_back(credit)
            self._local.hand_over(model_id)
        elif self._credits.idle_again(credit) and self._local.waiting(model_id):
            self._local.serve(model_id)

    def _idle_credit(self, model_id: str) -> HeldCredit | None:
        scheduler = self._scheduler
        return self._credits.take_idle(model_id, connected=scheduler.connected, session=scheduler.session)

    def _give_back(self, credit: HeldCredit) -> None:
        if self._credits.forget(credit) and credit.session == self._scheduler.session:
            self._scheduler.return_credit(credit.credit_id)

    def _arm(self, pending: _Pending, deadline_unix_ns: int) -> None:
        """Answer `expired` if the worker never replies (hung or dead) by deadline + grace."""
        delay = self._reply_grace_s
        if deadline_unix_ns:
            delay += max(0.0, deadline_unix_ns / 1e9 - self._clock.time())
        self._arm_at(pending, self._clock.monotonic() + delay)

    def _arm_at(self, pending: _Pending, reply_deadline: float) -> None:
        pending.reply_deadline = reply_deadline
        deadlines = self._reply_deadlines
        heapq.heappush(deadlines, (pending.reply_deadline, pending.call.request_id, pending.attempt))
        if len(deadlines) > 2 * len(self._pending) + 64:  # mostly answered calls: compact
            self._reply_deadlines = [
                (p.reply_deadline, p.call.request_id, p.attempt)
                for p in self._pending.values()
                if p.reply_deadline
            ]
            heapq.heapify(self._reply_deadlines)

    @staticmethod
    def _disarm(pending: _Pending) -> None:
        pending.reply_deadline = 0.0

    async def _watch(self) -> None:
        while True:
            await self._clock.sleep(_WATCH_INTERVAL_S)
            try:
                self._expire_overdue()
                self._local.forget_silent_clients()
                self._local.report_demand()
            except Exception:
                log.exception("reply watchdog step failed")

    def _expire_overdue(self) -> None:
        now = self._clock.monotonic()
        deadlines = self._reply_deadlines
        while deadlines and deadlines[0][0] <= now:
            due, request_id, attempt = heapq.heappop(deadlines)
            pending = self._pending.get(request_id)
            if pending is not None and pending.attempt == attempt and pending.reply_deadline == due:
                self._watchdog_fired(pending)

    def _watchdog_fired(self, pending: _Pending) -> None:
        if not pending.worker_id:
            return
        if pending.lost:
            self._worker_failed(pending, self._lost_error(pending))
            return
        request_id = pending.call.request_id
        worker_id = pending.worker_id
        error = ExpiredError(
            f"worker {worker_id} did not reply within {self._reply_grace_s:.0f}s of the deadline"
        )
        self._finish(pending, self._failed(pending.call, error))
        self._scheduler.complete(request_id, error_code=error.code, worker_id=worker_id)
        self._release_credit(pending, give_back=True)

    @staticmethod
    def _failed(call: InferenceCall, error: LoadmasterError) -> CallResult:
        return CallResult(request_id=call.request_id, model_id=call.model_id, error=error)

    def _finish(self, pending: _Pending, result: CallResult) -> None:
        """Deliver the result, then account for it (the caller's reply does not wait for that)."""
        self._forget(pending.call.request_id)
        self._disarm(pending)
        self._drop_shm(pending, answered=False)  # (a reply freed its slot before)
        call = pending.call
        latency_ms = (time.monotonic() - call.received_monotonic) * 1e3  # as the front ends stamp it
        try:
            pending.on_result(result)
        except Exception:
            log.exception(
                "delivering a result failed",
                extra={"request_id": call.request_id, "model": call.model_id, "client": call.client_id},
            )
        code = "ok" if result.error is None else result.error.edge_code
        labels = {"model": call.model_id if code != _NOT_FOUND else "(unknown)", "code": code}
        if call.client_type:  # the protocol (kserve, openpi, gr00t), or an edge client's own type
            labels["client_type"] = call.client_type
        tracing.end_span(pending.span, error_code="" if result.error is None else code)
        self._telemetry.record("requests", 1, labels)
        self._telemetry.record("e2e_latency_ms", latency_ms, labels)
