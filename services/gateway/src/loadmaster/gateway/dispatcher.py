"""The one dispatcher behind every front end (edge ZMQ, KServe v2 gRPC and HTTP).

A call's path: `submit` registers it and enqueues its metadata with the
scheduler; a Grant sends descriptors + payload to the granted worker's data
port; the worker's reply (or a Reject, or the reply watchdog) finishes the call
exactly once through its callback, and the scheduler is told with Complete.
A retryable worker failure is not answered: the scheduler re-grants (possibly
elsewhere) or rejects. Replies from an earlier grant's worker are ignored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from loadmaster.common import tracing
from loadmaster.common.errors import (
    ExpiredError,
    LoadmasterError,
    UnavailableError,
    edge_code_name,
    error_for_code,
)
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.gateway.calls import CallResult, InferenceCall, ResultCallback
from loadmaster.gateway.scheduler_link import SchedulerLink
from loadmaster.gateway.worker_link import WorkerLinks
from loadmaster.v1 import errors_pb2, model_pool_pb2, scheduler_pb2

__all__ = ["Dispatcher"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pending:
    call: InferenceCall
    on_result: ResultCallback
    worker_id: str = ""
    attempt: int = 0
    watchdog: asyncio.TimerHandle | None = None
    span: trace.Span = trace.INVALID_SPAN  # recording only while tracing is on


class Dispatcher:
    def __init__(
        self,
        *,
        telemetry: TelemetryReporter,
        reply_grace_s: float = 10.0,
    ) -> None:
        self._telemetry = telemetry
        self._reply_grace_s = reply_grace_s
        self._pending: dict[str, _Pending] = {}
        self._scheduler: SchedulerLink | None = None
        self._workers: WorkerLinks | None = None

    def attach(self, scheduler: SchedulerLink, workers: WorkerLinks) -> None:
        self._scheduler = scheduler
        self._workers = workers

    @property
    def inflight(self) -> int:
        return len(self._pending)

    # -- front-end API ------------------------------------------------------------------

    def submit(self, call: InferenceCall, on_result: ResultCallback) -> None:
        """Start `call`; `on_result` is called exactly once with its outcome."""
        assert self._scheduler is not None
        if not self._scheduler.connected:
            on_result(self._failed(call, UnavailableError("scheduler unreachable; try again shortly")))
            return
        if call.request_id in self._pending:
            on_result(self._failed(call, UnavailableError(f"duplicate request id {call.request_id}")))
            return
        span = tracing.start_request_span(
            "gateway.request", request_id=call.request_id, model_id=call.model_id, kind=SpanKind.SERVER
        )
        self._pending[call.request_id] = _Pending(call, on_result, span=span)
        info = scheduler_pb2.RequestInfo(
            request_id=call.request_id,
            client_id=call.client_id,
            model_id=call.model_id,
            priority=call.priority,
            urgency=call.urgency,
            steps_remaining=call.steps_remaining,
            received_unix_ns=call.received_unix_ns,
            timeout_ms=call.timeout_ms,
            payload_bytes=len(call.payload),
            client_type=call.client_type,
        )
        if span.is_recording():
            tracing.inject(info.trace_context, span=span)
        self._scheduler.enqueue(info)

    def cancel(self, request_id: str) -> None:
        """The caller went away: drop its queued request; no reply is sent."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        self._disarm(pending)
        tracing.end_span(pending.span, error_code="cancelled")
        assert self._scheduler is not None
        if pending.worker_id:
            self._scheduler.complete(request_id, error_code=errors_pb2.ERROR_CODE_CANCELLED)
        else:
            self._scheduler.cancel(request_id)

    # -- scheduler callbacks -------------------------------------------------------------

    def on_grant(self, grant: scheduler_pb2.Grant) -> None:
        assert self._scheduler is not None and self._workers is not None
        pending = self._pending.get(grant.request_id)
        if pending is None:  # cancelled or answered meanwhile: give the slot back
            self._scheduler.complete(grant.request_id, error_code=errors_pb2.ERROR_CODE_CANCELLED)
            return
        pending.worker_id = grant.worker_id
        pending.attempt = grant.attempt
        call = pending.call
        request = model_pool_pb2.InferRequest(
            request_id=call.request_id,
            model_id=call.model_id,
            inputs=call.inputs,
            metadata=call.metadata,
            deadline_unix_ns=grant.deadline_unix_ns,
            generation=grant.generation,
        )
        if pending.span.is_recording():
            tracing.inject(request.metadata, span=pending.span)
        envelope = request.SerializeToString()
        try:
            self._workers.send(grant.data_endpoint, envelope, call.payload)
        except UnavailableError as error:
            log.warning("request %s: %s", call.request_id, error.message)
            self._telemetry.record("dispatch_errors", 1, {"model": call.model_id, "code": error.edge_code})
            pending.worker_id = ""
            self._scheduler.complete(
                call.request_id, error_code=error.code, retryable=True, worker_id=grant.worker_id
            )
            return
        self._arm(pending, grant.deadline_unix_ns)

    def on_reject(self, reject: scheduler_pb2.Reject) -> None:
        pending = self._pending.get(reject.request_id)
        if pending is None:
            return
        self._finish(pending, self._failed(pending.call, error_for_code(reject.error_code, reject.message)))

    def on_scheduler_lost(self) -> None:
        """Calls still waiting for a grant will never get one: answer them now."""
        waiting = [p for p in self._pending.values() if not p.worker_id]
        for pending in waiting:
            self._finish(pending, self._failed(pending.call, UnavailableError("scheduler connection lost")))

    # -- worker callback -----------------------------------------------------------------

    def on_worker_reply(self, reply: model_pool_pb2.InferReply, payload: Any) -> None:
        assert self._scheduler is not None
        pending = self._pending.get(reply.request_id)
        if pending is None or reply.worker_id != pending.worker_id:
            return  # a late reply to an earlier grant, or to a call already answered
        code = reply.error_code
        if code and reply.retryable:
            self._disarm(pending)
            pending.worker_id = ""
            self._telemetry.record("dispatch_retries", 1, {"model": reply.model_id})
            self._scheduler.complete(
                reply.request_id, error_code=code, retryable=True, worker_id=reply.worker_id
            )
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
        self._finish(pending, result)
        self._scheduler.complete(
            reply.request_id,
            error_code=code,
            worker_id=reply.worker_id,
            inference_ms=reply.inference_latency_ms,
        )

    # -- internals -----------------------------------------------------------------------

    def _arm(self, pending: _Pending, deadline_unix_ns: int) -> None:
        """Answer `expired` if the worker never replies (hung or dead) by deadline + grace."""
        self._disarm(pending)
        delay = self._reply_grace_s
        if deadline_unix_ns:
            delay += max(0.0, deadline_unix_ns / 1e9 - time.time())
        pending.watchdog = asyncio.get_running_loop().call_later(
            delay, self._watchdog_fired, pending.call.request_id, pending.attempt
        )

    @staticmethod
    def _disarm(pending: _Pending) -> None:
        if pending.watchdog is not None:
            pending.watchdog.cancel()
            pending.watchdog = None

    def _watchdog_fired(self, request_id: str, attempt: int) -> None:
        pending = self._pending.get(request_id)
        if pending is None or pending.attempt != attempt or not pending.worker_id:
            return
        assert self._scheduler is not None
        worker_id = pending.worker_id
        error = ExpiredError(
            f"worker {worker_id} did not reply within {self._reply_grace_s:.0f}s of the deadline"
        )
        self._finish(pending, self._failed(pending.call, error))
        self._scheduler.complete(request_id, error_code=error.code, worker_id=worker_id)

    @staticmethod
    def _failed(call: InferenceCall, error: LoadmasterError) -> CallResult:
        return CallResult(request_id=call.request_id, model_id=call.model_id, error=error)

    def _finish(self, pending: _Pending, result: CallResult) -> None:
        self._pending.pop(pending.call.request_id, None)
        self._disarm(pending)
        call = pending.call
        code = "ok" if result.error is None else result.error.edge_code
        model = call.model_id if code != edge_code_name(errors_pb2.ERROR_CODE_NOT_FOUND) else "(unknown)"
        labels = {"model": model, "code": code}
        tracing.end_span(pending.span, error_code="" if result.error is None else code)
        self._telemetry.record("requests", 1, labels)
        self._telemetry.record("e2e_latency_ms", (time.monotonic() - call.received_monotonic) * 1e3, labels)
        try:
            pending.on_result(result)
        except Exception:
            log.exception("delivering the result of %s failed", call.request_id)
