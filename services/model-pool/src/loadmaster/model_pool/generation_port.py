"""Generation streams on the worker's data port (docs/generative.md, model_pool.proto).

    in   [identity, GENERATE_REQUEST_FRAME, GenerateRequest]
         [identity, GENERATE_CANCEL_FRAME, CancelGeneration]
    out  [identity, GENERATE_REPLIES_FRAME, GenerateReplies]

The frame where a tensor request has its empty delimiter names the message (the constants
live in loadmaster.common.framing), so one ROUTER socket carries tensors and streams.

A GenerateRequest is admitted on its model's slot (`ModelPool.open_generation`) and holds
that admission until its terminal reply, so `max_inflight`, keep-alive and eviction count
it and never unload a model mid-stream. One queue orders it (docs/generation-scheduling.md):
an engine that orders its own generations (`orders_generations`: the transformers engine,
whose scheduler inside the batching loop pauses lower-priority sequences for urgent ones)
gets every stream at once; for any other engine the model's `Sequencer` admits at most its
`max_sequences`, in the same order (priority class, tenant counter, arrival). Each
running stream has one task that reads its engine stream; the replies of every stream that
are ready in one loop turn go out together, one GenerateReplies per gateway (`_flush`).
A stream that waits gets a `progress` reply (the requests ahead of it) within a second of
arriving, then at most once a second while that number changes.

Nothing here grows with the input on the loop: prompts are tokenised by the engine in a
thread; the loop parses the envelope (bounded by the gateway's body limit) and moves
replies. A slow HTTP client never stalls the worker: ROUTER sends do not block, and the
gateway reads every reply as it comes and buffers per stream (at most max_tokens chunks).
Every failure is a terminal reply: a stream that cannot start is answered with sequence 0.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError

from loadmaster.common import internal_auth
from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.credentials import ENVELOPE_KEY
from loadmaster.common.errors import (
    ExpiredError,
    InternalError,
    InvalidArgumentError,
    LoadmasterError,
    UnauthenticatedError,
    UnavailableError,
)
from loadmaster.common.framing import GENERATE_CANCEL_FRAME, GENERATE_REQUEST_FRAME
from loadmaster.model_pool.generation import (
    FinishReason,
    GenerationEnd,
    GenerationEvent,
    GenerationRequest,
    GenerationStats,
    TokenChunk,
    Usage,
)
from loadmaster.model_pool.generation_order import OrderPolicy, Transition
from loadmaster.model_pool.generation_wire import reply_to_proto, request_from_proto
from loadmaster.model_pool.pool import GenerationAdmission, ModelPool
from loadmaster.model_pool.sequencing import Sequencer
from loadmaster.v1 import errors_pb2, model_pool_pb2

__all__ = ["GenerationPort"]

log = logging.getLogger(__name__)

_CANCEL_PREFIX = "cancel:"  # a CancelGeneration's credential is signed over this + the request id
Sender = Callable[[bytes, bytes], None]  # (identity, GenerateReplies bytes)
PROGRESS_TICK_S = 0.25  # how often waiting streams are looked at
PROGRESS_FIRST_S = 0.5  # a stream still waiting this long after it arrived gets its first progress reply
PROGRESS_EVERY_S = 1.0  # then at most one per this long, while its place changes


@dataclass(slots=True, eq=False)
class _Stream:
    identity: bytes
    request: GenerationRequest
    model_id: str
    admission: GenerationAdmission
    received: float  # clock.monotonic()
    started: float = 0.0
    first_token: float = 0.0
    task: asyncio.Task[None] | None = None
    engine_stream: Any = None
    cancel_reason: str = ""  # set when cancelled before the engine had it
    sent: int = 0  # replies queued so far (the next sequence number)
    ended: bool = False
    ahead_sent: int = -1  # the queue position its last progress reply gave
    progress_at: float = 0.0  # when that reply was sent
    deadline_unix_ns: int = 0  # no first token by then: it expires while it waits (0: never)
    expired: bool = False


@dataclass(slots=True)
class _Model:
    sequencer: Sequencer | None  # None: the engine orders its own generations
    streams: dict[str, _Stream] = field(default_factory=dict)


class GenerationPort:
    def __init__(
        self,
        pool: ModelPool,
        *,
        worker_id: str,
        send: Sender,
        clock: Clock | None = None,
        metrics: Any = None,
        policy: OrderPolicy | None = None,
    ) -> None:
        self._pool = pool
        self._worker_id = worker_id
        self._send = send
        self._clock = clock or SystemClock()
        self._metrics = metrics
        self._policy = policy or pool.order_policy
        self._models: dict[str, _Model] = {}
        self._streams: dict[str, _Stream] = {}
        self._outbox: dict[bytes, list[model_pool_pb2.GenerateReply]] = {}
        self._flush_scheduled = False
        self._progress_task: asyncio.Task[None] | None = None
        self._prefix_seen: dict[str, tuple[int, ...]] = {}  # model -> the engine's last prefix counters
        self._scheduling_seen: dict[str, tuple[int, ...]] = {}  # model -> the engine's last pause counts

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def sequences(self, model_id: str) -> tuple[int, int]:
        """(running, waiting) generations of `model_id` here."""
        model = self._models.get(model_id)
        if model is None:
            return (0, 0)
        if model.sequencer is not None:
            return (model.sequencer.running, model.sequencer.waiting)
        stream = next(iter(model.streams.values()), None)
        if stream is None:
            return (0, 0)
        stats = stream.admission.engine.stats()
        return (stats.running, stats.waiting)

    def tenant_service(self) -> dict[str, dict[str, float]]:
        """Per model served here: the weighted service each tenant got (cumulative)."""
        out: dict[str, dict[str, float]] = {}
        for model_id, model in self._models.items():
            if model.sequencer is not None:
                service = model.sequencer.tenant_service()
            else:
                engine = self._pool.generative_engine(model_id)
                service = engine.tenant_service() if engine is not None else {}
            if service:
                out[model_id] = service
        return out

    def set_remote_service(self, models: dict[str, dict[str, float]]) -> None:
        """What each tenant got from each model on the other workers (the scheduler's exchange)."""
        for model_id, service in models.items():
            model = self._models.get(model_id)
            if model is not None and model.sequencer is not None:
                model.sequencer.set_remote_service(service)
                continue
            engine = self._pool.generative_engine(model_id)
            if engine is not None:
                engine.set_remote_service(service)

    # ---- receiving (on the loop) --------------------------------------------------

    def handle(self, identity: bytes, kind: bytes, envelope: Any) -> None:
        if kind == GENERATE_CANCEL_FRAME:
            cancel = model_pool_pb2.CancelGeneration()
            try:
                cancel.ParseFromString(envelope)
            except (DecodeError, TypeError, ValueError) as error:
                log.warning("malformed CancelGeneration: %s", error)
                return
            if self._refused(cancel.metadata, _CANCEL_PREFIX + cancel.request_id, cancel.request_id):
                return  # nothing is answered to a cancel
            self.cancel(cancel.request_id, cancel.reason or "cancelled")
            return
        assert kind == GENERATE_REQUEST_FRAME
        message = model_pool_pb2.GenerateRequest()
        try:
            message.ParseFromString(envelope)
        except (DecodeError, TypeError, ValueError) as error:
            self._refuse(
                identity, "", "", InvalidArgumentError(f"envelope is not a GenerateRequest: {error}")
            )
            return
        if self._refused(message.metadata, message.request_id, message.request_id):
            refused = UnauthenticatedError("data-port message without a valid internal credential")
            self._refuse(identity, message.request_id, message.model_id, refused)
            return
        self._open(identity, message)

    def _refused(self, metadata: Any, signed: str, request_id: str) -> bool:
        """With internal credentials on, a message must carry a valid, fresh one (as InferRequests)."""
        credentials = internal_auth.current()
        if credentials is None:
            return False
        try:
            credentials.verify_envelope(metadata, signed)
        except UnauthenticatedError as error:
            token = metadata.get(ENVELOPE_KEY, "")
            internal_auth.log_refusal(
                f"generation message {request_id[:64]!r}", "data port", token.partition(" ")[0], error.message
            )
            return True
        return False

    def _open(self, identity: bytes, message: model_pool_pb2.GenerateRequest) -> None:
        request_id, model_id = message.request_id, message.model_id
        if request_id in self._streams:
            self._refuse(
                identity,
                request_id,
                model_id,
                InvalidArgumentError(f"request_id: {request_id!r} is already open"),
            )
            return
        try:
            request = request_from_proto(message)
            admission = self._pool.open_generation(model_id, deadline_unix_ns=message.deadline_unix_ns)
            if message.HasField("keep_alive_s"):  # Ollama's keep_alive (docs/dialects.md)
                self._pool.set_keep_alive(model_id, message.keep_alive_s)
        except Exception as error:
            self._refuse(identity, request_id, model_id, error)
            return
        now = self._clock.monotonic()
        stream = _Stream(identity, request, model_id, admission, received=now)
        stream.deadline_unix_ns = message.deadline_unix_ns
        model = self._model(model_id, admission)
        model.streams[request_id] = stream
        self._streams[request_id] = stream
        if model.sequencer is None:
            self._start(model, stream)
        else:
            transitions = model.sequencer.arrive(
                request_id,
                priority=request.priority,
                tenant=request.tenant,
                weight=request.tenant_weight,
                now=now,
            )
            self._act(model, transitions)
        self._watch_progress()
        self._record_sequences(model_id, model)

    def _model(self, model_id: str, admission: GenerationAdmission) -> _Model:
        """The model's bookkeeping; made anew while idle (a reload may change its engine)."""
        ordered = bool(getattr(admission.engine, "orders_generations", False))
        model = self._models.get(model_id)
        stale = (
            model is not None
            and not model.streams
            and (
                (model.sequencer is None) != ordered
                or (model.sequencer is not None and model.sequencer.capacity != admission.sequences)
            )
        )
        if model is None or stale:
            pausable = callable(getattr(admission.engine, "preempt", None))
            sequencer = None if ordered else Sequencer(admission.sequences, self._policy, can_pause=pausable)
            model = self._models[model_id] = _Model(sequencer)
        return model

    def cancel(self, request_id: str, reason: str) -> None:
        """Idempotent: an unknown or finished stream is left alone."""
        stream = self._streams.get(request_id)
        if stream is None or stream.ended:
            return
        model = self._models[stream.model_id]
        if stream.engine_stream is not None:
            stream.admission.engine.cancel(request_id)  # its task sends the cancelled terminal
            return
        stream.cancel_reason = reason
        if stream.task is None and model.sequencer is not None and model.sequencer.is_waiting(request_id):
            usage = Usage(prompt_tokens=0, completion_tokens=0)
            self._terminal(stream, GenerationEnd(request_id, 0, FinishReason.CANCELLED, usage, reason))
        # else: being submitted; the task cancels it once the engine has it

    async def close(self) -> None:
        """Stop every stream (the worker is stopping): each gets its terminal."""
        for stream in list(self._streams.values()):
            self.cancel(stream.request.request_id, "the worker is shutting down")
        tasks = [s.task for s in self._streams.values() if s.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        if self._progress_task is not None:
            self._progress_task.cancel()
        self._flush()

    # ---- starting -----------------------------------------------------------------

    def _act(self, model: _Model, transitions: list[tuple[Transition, str]]) -> None:
        """The sequencer's decisions: start a stream, or pause / resume one in its engine."""
        for kind, request_id in transitions:
            stream = model.streams.get(request_id)
            if stream is None:
                continue
            if kind is Transition.START:
                self._start(model, stream)
            elif kind is Transition.PAUSE:
                stream.admission.engine.preempt(request_id)
            else:
                stream.admission.engine.resume(request_id)

    def _start(self, model: _Model, stream: _Stream) -> None:
        stream.started = self._clock.monotonic()
        stream.task = asyncio.create_task(
            self._run(model, stream), name=f"generate-{stream.request.request_id}"
        )

    # ---- one stream ---------------------------------------------------------------

    async def _run(self, model: _Model, stream: _Stream) -> None:
        request_id = stream.request.request_id
        engine = stream.admission.engine
        if stream.request.images and not getattr(engine, "takes_images", False):
            refused = InvalidArgumentError(
                f"model '{stream.model_id}' takes no images: send text only, or ask a vision-language model"
            )
            self._refuse_admitted(stream, refused)
            return
        try:
            engine_stream = await engine.submit(stream.request)
        except Exception as error:
            self._refuse_admitted(stream, error)
            if not getattr(engine, "healthy", True):  # its batching thread died: reload it
                self._pool.engine_failed(stream.model_id, stream.admission.generation, str(error))
            return
        stream.engine_stream = engine_stream
        if stream.cancel_reason:
            engine.cancel(request_id)
        if model.sequencer is not None:
            model.sequencer.charge_prompt(request_id, getattr(engine_stream, "prompt_tokens", 0))
        try:
            async for first in engine_stream:
                events: list[GenerationEvent] = [first, *engine_stream.ready()]
                tokens = 0
                for event in events:
                    if isinstance(event, GenerationEnd):
                        self._terminal(stream, event)
                        return
                    tokens += len(event.token_ids)
                    self._chunk(stream, event)
                if model.sequencer is not None:
                    self._act(model, model.sequencer.progressed(request_id, tokens, self._clock.monotonic()))
        except Exception as error:  # never leave a stream without its terminal
            log.exception("generation %s failed", request_id)
            engine.cancel(request_id)
            self._refuse_admitted(stream, error)
        finally:
            if not stream.ended:
                engine.cancel(request_id)
                self._terminal(
                    stream,
                    GenerationEnd(
                        request_id, stream.sent, FinishReason.ERROR, Usage(0, 0), "stream ended early"
                    ),
                )

    # ---- where waiting streams stand ----------------------------------------------

    def _watch_progress(self) -> None:
        if self._progress_task is None or self._progress_task.done():
            self._progress_task = asyncio.create_task(self._progress_loop(), name="generation-progress")

    async def _progress_loop(self) -> None:
        """While any stream waits for its first token: each gets a progress reply within
        PROGRESS_FIRST_S of arriving, then at most once per PROGRESS_EVERY_S while its place
        changes, and one whose deadline passes leaves the queue, answered `expired` (a gateway
        that places generations itself gives each its deadline). Ends when no stream is open."""
        while self._streams:
            await asyncio.sleep(PROGRESS_TICK_S)
            try:
                self._send_progress(self._clock.monotonic())
            except Exception:
                log.exception("generation progress failed")

    def _send_progress(self, now: float) -> None:
        wall_ns = self._clock.time() * 1e9
        for model in self._models.values():
            for stream in list(model.streams.values()):
                if stream.ended or stream.first_token:
                    continue
                if stream.deadline_unix_ns and wall_ns >= stream.deadline_unix_ns:
                    self._expire(model, stream)
                    continue
                if now - stream.received < PROGRESS_FIRST_S:
                    continue
                ahead = self._ahead(model, stream, now)
                if ahead is None or ahead == stream.ahead_sent:
                    continue
                if stream.ahead_sent >= 0 and now - stream.progress_at < PROGRESS_EVERY_S:
                    continue
                stream.ahead_sent, stream.progress_at = ahead, now
                reply = model_pool_pb2.GenerateReply(
                    request_id=stream.request.request_id,
                    model_id=stream.model_id,
                    worker_id=self._worker_id,
                    generation=stream.admission.generation,
                )
                reply.progress.queued_ahead = ahead
                self._outbox.setdefault(stream.identity, []).append(reply)  # no sequence number
                self._schedule_flush()

    def _expire(self, model: _Model, stream: _Stream) -> None:
        """Its deadline passed before its first token: it leaves the queue, answered `expired`."""
        stream.expired = True
        request_id = stream.request.request_id
        if stream.engine_stream is not None:
            stream.admission.engine.cancel(request_id)  # its task sends the (expired) terminal
            return
        stream.cancel_reason = "expired"
        if stream.task is None and model.sequencer is not None and model.sequencer.is_waiting(request_id):
            self._refuse_admitted(stream, ExpiredError("the generation waited past its deadline"))

    def _ahead(self, model: _Model, stream: _Stream, now: float) -> int | None:
        request_id = stream.request.request_id
        if model.sequencer is not None:
            return model.sequencer.position(request_id, now)
        position = getattr(stream.admission.engine, "queue_position", None)
        return position(request_id) if position is not None else None

    def _chunk(self, stream: _Stream, event: TokenChunk) -> None:
        now = self._clock.monotonic()
        if not stream.first_token:
            stream.first_token = now
            labels = {"model": stream.model_id, "priority": str(stream.request.priority)}
            self._record_labels("generation_queue_wait_ms", (now - stream.received) * 1e3, labels)
        self._queue(
            stream,
            reply_to_proto(
                event,
                model_id=stream.model_id,
                worker_id=self._worker_id,
                generation=stream.admission.generation,
            ),
        )

    def _terminal(self, stream: _Stream, end: GenerationEnd) -> None:
        if stream.ended:
            return
        if stream.expired and end.finish_reason is FinishReason.CANCELLED:
            self._refuse_admitted(stream, ExpiredError("the generation waited past its deadline"))
            return
        stream.ended = True
        code = (
            errors_pb2.ERROR_CODE_UNAVAILABLE if "unloaded" in end.error else errors_pb2.ERROR_CODE_INTERNAL
        )
        reply = reply_to_proto(
            end,
            model_id=stream.model_id,
            worker_id=self._worker_id,
            generation=stream.admission.generation,
            error_code=code,
            retryable=code == errors_pb2.ERROR_CODE_UNAVAILABLE,
        )
        if reply.HasField("result"):
            now = self._clock.monotonic()
            reply.result.queue_ms = max(0.0, (stream.started or now) - stream.received) * 1e3
            if stream.first_token:
                reply.result.time_to_first_token_ms = (stream.first_token - stream.received) * 1e3
        self._queue(stream, reply)
        self._closed(stream, end.usage)

    def _refuse_admitted(self, stream: _Stream, error: BaseException) -> None:
        """An admitted stream that could not start (bad prompt, model gone): one error terminal."""
        if stream.ended:
            return
        stream.ended = True
        self._queue(stream, self._error_reply(stream.request.request_id, stream.model_id, error, stream.sent))
        self._closed(stream, Usage(0, 0))

    def _closed(self, stream: _Stream, usage: Usage) -> None:
        request_id = stream.request.request_id
        self._streams.pop(request_id, None)
        model = self._models.get(stream.model_id)
        stream.admission.release()
        if usage.prompt_tokens or usage.completion_tokens:
            self._record("prompt_tokens", float(usage.prompt_tokens), stream.model_id)
            self._record("output_tokens", float(usage.completion_tokens), stream.model_id)
            tenant = {"model": stream.model_id, "tenant": stream.request.tenant or "-"}
            self._record_labels("tenant_prompt_tokens", float(usage.prompt_tokens), tenant)
            self._record_labels("tenant_output_tokens", float(usage.completion_tokens), tenant)
        if model is not None:
            model.streams.pop(request_id, None)
            if model.sequencer is not None:
                self._act(model, model.sequencer.finished(request_id, self._clock.monotonic()))
            self._record_sequences(stream.model_id, model, engine=stream.admission.engine)

    # ---- answering ----------------------------------------------------------------

    def _error_reply(
        self, request_id: str, model_id: str, error: BaseException, sequence: int
    ) -> model_pool_pb2.GenerateReply:
        if isinstance(error, LoadmasterError):
            known = error
        else:
            log.error("generation %s refused", request_id, exc_info=error)
            known = InternalError(f"internal error: {type(error).__name__}: {error}")
        reply = model_pool_pb2.GenerateReply(
            request_id=request_id, model_id=model_id, sequence=sequence, worker_id=self._worker_id
        )
        reply.error.error_code = known.code  # type: ignore[assignment]
        reply.error.error_message = known.message
        reply.error.retryable = sequence == 0 and isinstance(known, UnavailableError)
        return reply

    def _refuse(self, identity: bytes, request_id: str, model_id: str, error: BaseException) -> None:
        reply = self._error_reply(request_id, model_id, error, 0)
        self._outbox.setdefault(identity, []).append(reply)
        self._schedule_flush()

    def _queue(self, stream: _Stream, reply: model_pool_pb2.GenerateReply) -> None:
        reply.sequence = stream.sent  # the engine numbers chunks the same way; a refusal is 0
        stream.sent += 1
        self._outbox.setdefault(stream.identity, []).append(reply)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Every reply queued in this loop turn leaves now: one GenerateReplies per gateway."""
        self._flush_scheduled = False
        outbox, self._outbox = self._outbox, {}
        for identity, replies in outbox.items():
            self._send(identity, model_pool_pb2.GenerateReplies(replies=replies).SerializeToString())

    # ---- metrics ------------------------------------------------------------------

    def _record_sequences(self, model_id: str, model: _Model, *, engine: Any = None) -> None:
        if self._metrics is None:
            return
        stream = next(iter(model.streams.values()), None)
        stats = engine or getattr(getattr(stream, "admission", None), "engine", None)
        if model.sequencer is not None:
            self._record("sequences_running", float(model.sequencer.running), model_id)
            self._record("sequences_waiting", float(model.sequencer.waiting), model_id)
        if stats is None:
            return
        try:
            snapshot = stats.stats()
        except Exception:
            return
        if model.sequencer is None:
            self._record("sequences_running", float(snapshot.running), model_id)
            self._record("sequences_waiting", float(snapshot.waiting), model_id)
        self._record("kv_cache_blocks_used", float(snapshot.kv_blocks_used), model_id)
        self._record("kv_cache_blocks_total", float(snapshot.kv_blocks_total), model_id)
        if isinstance(snapshot, GenerationStats):
            self._record_prefix(model_id, snapshot)
        scheduling = getattr(stats, "scheduling", None)
        if scheduling is not None:
            self._record_scheduling(model_id, scheduling())

    def _record_scheduling(self, model_id: str, snapshot: Any) -> None:
        """The engine scheduler's counts since its load (`_cb_scheduler.SchedulerSnapshot`):
        record what they grew by, and the largest gap between backlogged tenants' counters."""
        counts = (
            snapshot.preemptions,
            snapshot.yields,
            snapshot.resumes,
            snapshot.kv_kept,
            snapshot.kv_recomputed,
        )
        seen = self._scheduling_seen.get(model_id, (0,) * len(counts))
        if any(now < before for now, before in zip(counts, seen, strict=True)):
            seen = (0,) * len(counts)  # reloaded: counting again from zero
        self._scheduling_seen[model_id] = counts
        names = ("preemptions", "yields", "resumptions", "kv_kept", "kv_recomputed")
        for name, now, before in zip(names, counts, seen, strict=True):
            if now > before:
                self._record(name, float(now - before), model_id)
        self._record("tenant_counter_gap", float(snapshot.counter_gap), model_id)

    def _record_prefix(self, model_id: str, snapshot: GenerationStats) -> None:
        """The engine's prefix counters are cumulative since its load: record what they grew by
        (all of them after a reload, when they start again below what was seen)."""
        counters = (
            snapshot.prefix_lookups,
            snapshot.prefix_hits,
            snapshot.prefix_tokens_reused,
            snapshot.prefix_blocks_evicted,
        )
        seen = self._prefix_seen.get(model_id, (0, 0, 0, 0))
        if any(now < before for now, before in zip(counters, seen, strict=True)):
            seen = (0, 0, 0, 0)
        self._prefix_seen[model_id] = counters
        names = (
            "prefix_cache_queries",
            "prefix_cache_hits",
            "prefix_cache_reused_tokens",
            "prefix_cache_evicted_blocks",
        )
        for name, now, before in zip(names, counters, seen, strict=True):
            if now > before:
                self._record(name, float(now - before), model_id)
        self._record("prefix_cache_blocks", float(snapshot.prefix_blocks_cached), model_id)

    def _record(self, name: str, value: float, model_id: str) -> None:
        self._record_labels(name, value, {"model": model_id})

    def _record_labels(self, name: str, value: float, labels: dict[str, str]) -> None:
        if self._metrics is not None:
            self._metrics.record(name, value, labels)
