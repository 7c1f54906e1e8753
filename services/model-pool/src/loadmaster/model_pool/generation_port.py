"""Generation streams on the worker's data port (docs/generative.md, model_pool.proto).

    in   [identity, GENERATE_REQUEST_FRAME, GenerateRequest]
         [identity, GENERATE_CANCEL_FRAME, CancelGeneration]
    out  [identity, GENERATE_REPLIES_FRAME, GenerateReplies]

The frame where a tensor request has its empty delimiter names the message (the constants
live in loadmaster.common.framing), so one ROUTER socket carries tensors and streams.

A GenerateRequest is admitted on its model's slot (`ModelPool.open_generation`) and holds
that admission until its terminal reply, so `max_inflight`, keep-alive and eviction count
it and never unload a model mid-stream. The model's `Sequencer` decides when it runs: at
most the engine's `max_sequences` at once, the most urgent first, and a priority-0 stream
may take the sequence of the lowest-priority one (engine.preempt / engine.resume). Each
running stream has one task that reads its engine stream; the replies of every stream that
are ready in one loop turn go out together, one GenerateReplies per gateway (`_flush`).

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
from loadmaster.common.errors import (
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
from loadmaster.model_pool.generation_wire import reply_to_proto, request_from_proto
from loadmaster.model_pool.pool import GenerationAdmission, ModelPool
from loadmaster.model_pool.sequencing import Action, ActionKind, Sequencer
from loadmaster.v1 import errors_pb2, model_pool_pb2

__all__ = ["GenerationPort"]

log = logging.getLogger(__name__)

_CANCEL_PREFIX = "cancel:"  # a CancelGeneration's credential is signed over this + the request id
Sender = Callable[[bytes, bytes], None]  # (identity, GenerateReplies bytes)


@dataclass(slots=True, eq=False)
class _Stream:
    identity: bytes
    request: GenerationRequest
    model_id: str
    priority: int
    admission: GenerationAdmission
    received: float  # clock.monotonic()
    started: float = 0.0
    first_token: float = 0.0
    task: asyncio.Task[None] | None = None
    engine_stream: Any = None
    cancel_reason: str = ""  # set when cancelled before the engine had it
    sent: int = 0  # replies queued so far (the next sequence number)
    ended: bool = False


@dataclass(slots=True)
class _Model:
    sequencer: Sequencer
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
    ) -> None:
        self._pool = pool
        self._worker_id = worker_id
        self._send = send
        self._clock = clock or SystemClock()
        self._metrics = metrics
        self._models: dict[str, _Model] = {}
        self._streams: dict[str, _Stream] = {}
        self._outbox: dict[bytes, list[model_pool_pb2.GenerateReply]] = {}
        self._flush_scheduled = False
        self.preemptions = 0
        self.resumptions = 0
        self._prefix_seen: dict[str, tuple[int, ...]] = {}  # model -> the engine's last prefix counters

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def sequences(self, model_id: str) -> tuple[int, int]:
        """(running, waiting) sequences of `model_id` here."""
        model = self._models.get(model_id)
        return (model.sequencer.running, model.sequencer.waiting) if model else (0, 0)

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
            token = metadata.get(internal_auth.ENVELOPE_KEY, "")
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
        stream = _Stream(
            identity, request, model_id, message.priority, admission, received=self._clock.monotonic()
        )
        model = self._models.get(model_id)
        if model is None or (not model.streams and model.sequencer.capacity != admission.sequences):
            model = self._models[model_id] = _Model(Sequencer(capacity=admission.sequences))
        model.streams[request_id] = stream
        self._streams[request_id] = stream
        self._act(model, model.sequencer.arrive(request_id, message.priority))
        self._record_sequences(model_id, model)

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
        if model.sequencer.is_waiting(request_id) and stream.task is None:
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
        self._flush()

    # ---- the sequencer's decisions ------------------------------------------------

    def _act(self, model: _Model, actions: list[Action]) -> None:
        for action in actions:
            stream = model.streams.get(action.request_id)
            if stream is None:
                continue
            engine = stream.admission.engine
            if action.kind is ActionKind.PREEMPT:
                if engine.preempt(action.request_id):
                    self.preemptions += 1
                    self._record("preemptions", 1.0, stream.model_id)
            elif action.kind is ActionKind.RESUME:
                try:
                    engine.resume(action.request_id)
                except LoadmasterError as error:
                    engine.cancel(action.request_id)
                    log.warning("resuming %s failed: %s", action.request_id, error.message)
                self.resumptions += 1
                self._record("resumptions", 1.0, stream.model_id)
            else:
                stream.started = self._clock.monotonic()
                stream.task = asyncio.create_task(
                    self._run(model, stream), name=f"generate-{action.request_id}"
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
        self._act(model, model.sequencer.submitted(request_id))
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
                self._act(model, model.sequencer.progressed(request_id, tokens))
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

    def _chunk(self, stream: _Stream, event: TokenChunk) -> None:
        now = self._clock.monotonic()
        if not stream.first_token:
            stream.first_token = now
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
        if model is not None:
            model.streams.pop(request_id, None)
            self._act(model, model.sequencer.finished(request_id))
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
        self._record("sequences_running", float(model.sequencer.running), model_id)
        self._record("sequences_waiting", float(model.sequencer.waiting), model_id)
        stream = next(iter(model.streams.values()), None)
        stats = engine or getattr(getattr(stream, "admission", None), "engine", None)
        if stats is not None:
            try:
                snapshot = stats.stats()
            except Exception:
                return
            self._record("kv_cache_blocks_used", float(snapshot.kv_blocks_used), model_id)
            self._record("kv_cache_blocks_total", float(snapshot.kv_blocks_total), model_id)
            if isinstance(snapshot, GenerationStats):
                self._record_prefix(model_id, snapshot)

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
        if self._metrics is not None:
            self._metrics.record(name, value, {"model": model_id})
