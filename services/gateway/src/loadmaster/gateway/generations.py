"""Generation streams through the suite: the `Generations` port behind the OpenAI routes.

A generation is queued like any request: `enqueue` to the scheduler (priority, urgency,
client, the deadline as `timeout_ms`), whose strategy orders it among the model's waiting
requests. Its Grant is a sequence slot, held until the stream's terminal reply, then given
back with `Complete`. The gateway sends `GenerateRequest` to the granted worker over the
existing data link (the frame names the message: loadmaster.common.framing) and reads the
`GenerateReplies` that come back:

    chunk ... chunk  ->  TextChunk ...      (chunks already here are joined into one)
    result           ->  Finished           (stop / length, usage, the model that answered)
    error            ->  the LoadmasterError of its code; before any chunk and retryable
                         (the model was unloading) the scheduler re-grants it instead
    cancelled        ->  only ever asked for: the stream's consumer left

Every stream's replies are checked for order and exactly-once (sequence numbers without a
gap, nothing after the terminal); a broken stream fails with `internal`. Closing the chunk
iterator early (the HTTP client left) cancels: `cancel` to the scheduler while queued, a
`CancelGeneration` to the worker once granted (its sequence is freed at the next decode
step; the slot is completed when the cancelled terminal arrives, or after a grace if it
never does). A deadline that passes while queued is the scheduler's Reject `expired`,
answered as `ExpiredError` (504).

The socket reader never waits on a consumer: replies go to a per-stream buffer, bounded by
the stream's max_tokens (a worker sends at most one chunk per token); a consumer that falls
further behind than `MAX_BUFFERED` replies is cancelled rather than let grow.

A stream that waits is told where it stands (`Waiting`, an SSE comment on the OpenAI route):
at the worker, from its `progress` replies (the requests ahead of it in the engine's queue);
before a grant, from here: its model loading (time since the load began / the last measured
load time), else the streams of its model waiting at this gateway ahead of it. The first
within `WAITING_FIRST_S`, then at most one per `WAITING_EVERY_S`, and only when it changed.
Each stream carries its tenant and the tenant's weight to the worker's queue, which is fair
between tenants within a priority (docs/generation-scheduling.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from loadmaster.common import internal_auth
from loadmaster.common.backends import GENERATIVE_BACKENDS
from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.errors import (
    InternalError,
    LoadmasterError,
    UnavailableError,
    error_for_code,
)
from loadmaster.common.framing import GENERATE_CANCEL_FRAME, GENERATE_REQUEST_FRAME
from loadmaster.common.rendezvous import affinity_rank
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.gateway.affinity import prefix_affinity_key
from loadmaster.gateway.catalog import ModelView
from loadmaster.gateway.drain import Drain, shutting_down
from loadmaster.gateway.generation import Finished, GenerationEvent, GenerationRequest, TextChunk, Waiting
from loadmaster.gateway.generation_items import (
    ChatTurn,
    ChoiceEnd,
    TokenLogprob,
    ToolCall,
    ToolUse,
    TopLogprob,
)
from loadmaster.gateway.ladders import REMOTE_BACKENDS, Ladder, LadderRouter, alias_states
from loadmaster.gateway.ports import SchedulerSession
from loadmaster.v1 import errors_pb2, model_pool_pb2, scheduler_pb2

__all__ = ["GenerationRouter", "GenerationStreams"]

log = logging.getLogger(__name__)

OPENAI_BACKENDS = GENERATIVE_BACKENDS | {"embedding"}  # what GET /v1/models lists
DEFAULT_MAX_TOKENS = 256  # when a request names none (OpenAI's own default is the context's rest)
DEFAULT_PRIORITY = 1  # as for tensor requests
MAX_BUFFERED = 8192  # replies one stream may have waiting for its consumer
CANCEL_GRACE_S = 10.0  # a cancelled stream's slot is completed by then even if the worker is silent
WAITING_FIRST_S = 0.5  # a stream not granted this long after it was opened is told where it stands
WAITING_EVERY_S = 1.0  # then at most once per this long, when that changed

CANCEL_PREFIX = "cancel:"  # a CancelGeneration's credential is signed over this + the request id
_FINISH = {
    model_pool_pb2.FINISH_REASON_STOP: "stop",
    model_pool_pb2.FINISH_REASON_LENGTH: "length",
    model_pool_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}


class _Workers(Protocol):
    def send_generation(self, endpoint: str, kind: bytes, envelope: bytes) -> None: ...


@dataclass(slots=True, eq=False)
class _Stream:
    request_id: str
    model_id: str
    message: model_pool_pb2.GenerateRequest
    received: float  # clock.monotonic()
    session: int
    events: asyncio.Queue[GenerationEvent | BaseException] = field(default_factory=asyncio.Queue)
    worker_id: str = ""  # set by a grant
    endpoint: str = ""
    expected: int = 0  # the next reply's sequence number
    chunks: int = 0
    last_chunk: float = 0.0
    cancelling: bool = False
    done: bool = False
    cancel_timer: asyncio.TimerHandle | None = None
    waiting_told: Waiting | None = None  # the last `Waiting` delivered
    waiting_at: float = 0.0
    info: scheduler_pb2.RequestInfo | None = None  # what the scheduler is told when it queues it
    placed: bool = False  # sent straight to a worker the scheduler placed the model on
    tried: set[str] = field(default_factory=set)  # workers that failed it before its first chunk
    enqueued: bool = False


@dataclass(frozen=True, slots=True)
class _Placed:
    worker_id: str
    endpoint: str
    generation: int


class GenerationStreams:
    """The gateway's open generations; the dispatcher forwards the scheduler's and workers'
    messages about them here (`on_grant`, `on_reject` ... return True when they were ours)."""

    def __init__(
        self,
        *,
        scheduler: SchedulerSession,
        workers: _Workers,
        telemetry: TelemetryReporter,
        clock: Clock | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        weights: Callable[[str], float] | None = None,
        model_view: Callable[[str], Awaitable[ModelView | None]] | None = None,
    ) -> None:
        """`weights`: a tenant's weight (the `tenants:` settings; 1 when unnamed). `model_view`:
        a model's catalog view, for `Waiting` while its load runs (None: never told loading)."""
        self._scheduler = scheduler
        self._workers = workers
        self._telemetry = telemetry
        self._clock: Clock = clock or SystemClock()
        self._default_max_tokens = default_max_tokens
        self.weights = weights or (lambda tenant: 1.0)
        self.model_view = model_view
        self._streams: dict[str, _Stream] = {}
        self._waiting_task: asyncio.Task[None] | None = None
        self._placements: dict[str, tuple[_Placed, ...]] = {}  # model -> where it is served
        self._placed_on: dict[str, int] = {}  # worker -> this gateway's streams placed there
        # a model's queue TTL (`request_ttl_ms`): a placed stream's deadline when it names none
        self.ttl_ms: Callable[[str], float] = lambda model_id: 60_000.0
        self._drain = Drain()

    @property
    def open(self) -> int:
        return len(self._streams)

    async def drain(self, timeout_s: float) -> int:
        """Refuse new streams (`unavailable`) from now on and wait, at most `timeout_s` (real
        time: the process is stopping), for the open ones to end. Returns how many are still
        open."""
        return await self._drain.wait(self._streams, timeout_s)

    # ---- the port ------------------------------------------------------------------

    async def generate(
        self, request: GenerationRequest, *, request_id: str, client_id: str, tenant: str = ""
    ) -> AsyncGenerator[GenerationEvent, None]:
        """`Waiting` while it waits, chunks, then one `Finished`; raises `LoadmasterError`.
        Closing it early cancels."""
        stream = self._open(request, request_id=request_id, client_id=client_id, tenant=tenant or client_id)
        try:
            while True:
                item = await stream.events.get()
                if isinstance(item, BaseException):
                    raise item
                while isinstance(item, TextChunk):
                    item = self._joined(stream, item)
                    if not isinstance(item, tuple):
                        break
                    yield item[0]  # text, then what ended the run (already here)
                    item = item[1]
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Finished):
                    return
        finally:
            if not stream.done:
                self._cancel(stream, "the client went away")

    def _open(self, request: GenerationRequest, *, request_id: str, client_id: str, tenant: str) -> _Stream:
        if self._drain.begun:
            raise shutting_down()
        if request_id in self._streams:
            raise UnavailableError(f"duplicate request id {request_id}")
        if not self._placements.get(request.model) and not self._scheduler.connected:
            raise UnavailableError("scheduler unreachable; try again shortly")
        message = _message(request, request_id=request_id, default_max_tokens=self._default_max_tokens)
        message.tenant = tenant
        message.tenant_weight = self.weights(tenant)
        stream = _Stream(request_id, request.model, message, self._clock.monotonic(), self._scheduler.session)
        ttl_s = (request.deadline_ms or self.ttl_ms(request.model)) / 1000.0
        message.deadline_unix_ns = int((self._clock.time() + ttl_s) * 1e9)
        stream.info = scheduler_pb2.RequestInfo(
            request_id=request_id,
            client_id=client_id,
            model_id=request.model,
            priority=message.priority,
            urgency=request.urgency or 0.0,
            received_unix_ns=int(self._clock.time() * 1e9),
            timeout_ms=request.deadline_ms or 0.0,
            payload_bytes=message.ByteSize(),
            client_type="openai",
            connection_bound=True,  # the stream is cancelled when its HTTP client goes
            affinity_key=prefix_affinity_key(request),
        )
        self._streams[request_id] = stream
        self._watch_waiting()
        if not self._place(stream):
            self._enqueue(stream)
        return stream

    # ---- placement -------------------------------------------------------------------

    def on_placement(self, placement: scheduler_pb2.Placement) -> None:
        """Where the scheduler says a generative model is served now (no worker: nowhere)."""
        placed = tuple(_Placed(w.worker_id, w.data_endpoint, w.generation) for w in placement.workers)
        if placed:
            self._placements[placement.model_id] = placed
        else:
            self._placements.pop(placement.model_id, None)

    def _place(self, stream: _Stream) -> bool:
        """Send `stream` straight to a worker that serves its model: the one its prompt prefix
        prefers (the scheduler's rendezvous score), else the one with the fewest streams placed
        from here; False when none is left to try (it then goes through the scheduler)."""
        candidates = [p for p in self._placements.get(stream.model_id, ()) if p.worker_id not in stream.tried]
        key = stream.info.affinity_key if stream.info is not None else ""
        while candidates:
            if key:
                chosen = max(candidates, key=lambda p: affinity_rank(key, p.worker_id))
            else:
                chosen = min(candidates, key=lambda p: (self._placed_on.get(p.worker_id, 0), p.worker_id))
            candidates.remove(chosen)
            stream.message.generation = chosen.generation
            if self._send(stream, chosen.endpoint):
                stream.worker_id, stream.endpoint, stream.expected = chosen.worker_id, chosen.endpoint, 0
                stream.placed = True
                self._placed_on[chosen.worker_id] = self._placed_on.get(chosen.worker_id, 0) + 1
                return True
            stream.tried.add(chosen.worker_id)
        return False

    def _enqueue(self, stream: _Stream) -> None:
        """Through the scheduler: it loads the model where none serves it, then grants."""
        if not self._scheduler.connected:
            self._fail(
                stream, UnavailableError("no worker serves the model and the scheduler is unreachable")
            )
            return
        assert stream.info is not None
        stream.enqueued, stream.session = True, self._scheduler.session
        self._scheduler.enqueue(stream.info)

    def _send(self, stream: _Stream, endpoint: str) -> bool:
        if (credentials := internal_auth.current()) is not None:  # a fresh one per send (replays refused)
            credentials.sign_envelope(stream.message.metadata, stream.request_id)
        try:
            self._workers.send_generation(
                endpoint, GENERATE_REQUEST_FRAME, stream.message.SerializeToString()
            )
        except UnavailableError:
            return False
        return True

    def _unplace(self, stream: _Stream) -> None:
        if stream.placed and stream.worker_id:
            left = self._placed_on.get(stream.worker_id, 1) - 1
            if left > 0:
                self._placed_on[stream.worker_id] = left
            else:
                self._placed_on.pop(stream.worker_id, None)
        stream.placed = False

    @staticmethod
    def _joined(stream: _Stream, first: TextChunk) -> TextChunk | tuple[TextChunk, Any]:
        """`first` and the chunks of the same choice already waiting behind it as one (a slow
        reader gets fewer, larger events); what follows them, if it is not one, comes along."""
        joined = first
        while not stream.events.empty():
            item = stream.events.get_nowait()
            if isinstance(item, TextChunk) and item.choice == joined.choice:
                joined = join_chunks(joined, item)
                continue
            return joined, item
        return joined

    # ---- from the scheduler ---------------------------------------------------------

    def on_grant(self, grant: scheduler_pb2.Grant) -> bool:
        stream = self._streams.get(grant.request_id)
        if stream is None:
            return False
        if stream.done or stream.cancelling:
            self._scheduler.complete(grant.request_id, error_code=errors_pb2.ERROR_CODE_CANCELLED)
            self._forget(stream)
            return True
        if stream.chunks:  # re-queued by the scheduler when its streaming worker went away
            self._scheduler.complete(grant.request_id, error_code=errors_pb2.ERROR_CODE_CANCELLED)
            self._fail(stream, UnavailableError(f"worker {stream.worker_id} went away while generating"))
            return True
        stream.worker_id, stream.endpoint = grant.worker_id, grant.data_endpoint
        stream.expected = 0
        stream.message.generation = grant.generation
        stream.message.deadline_unix_ns = grant.deadline_unix_ns
        if not self._send(stream, grant.data_endpoint):
            stream.worker_id = ""
            self._scheduler.complete(
                grant.request_id,
                error_code=errors_pb2.ERROR_CODE_UNAVAILABLE,
                retryable=True,
                worker_id=grant.worker_id,
            )
        return True

    def on_reject(self, reject: scheduler_pb2.Reject) -> bool:
        stream = self._streams.get(reject.request_id)
        if stream is None:
            return False
        self._fail(stream, error_for_code(reject.error_code, reject.message))
        return True

    def on_scheduler_lost(self) -> None:
        for stream in [s for s in self._streams.values() if not s.worker_id]:
            self._fail(stream, UnavailableError("scheduler connection lost"))

    # ---- from the workers ------------------------------------------------------------

    def on_replies(self, endpoint: str, message: model_pool_pb2.GenerateReplies) -> None:
        for reply in message.replies:
            stream = self._streams.get(reply.request_id)
            if stream is None or reply.worker_id != stream.worker_id or stream.endpoint != endpoint:
                continue  # a late reply to an earlier grant, or to a stream already ended
            try:
                self._accept(stream, reply)
            except LoadmasterError as error:
                log.error("generation %s from %s: %s", stream.request_id, endpoint, error.message)
                self._send_cancel(stream, "protocol error")
                self._complete(stream, error.code)
                self._fail(stream, error)

    def on_worker_lost(self, endpoint: str) -> None:
        for stream in [s for s in self._streams.values() if s.worker_id and s.endpoint == endpoint]:
            error = UnavailableError(f"worker {stream.worker_id} went away while generating")
            same_session = stream.placed or self._scheduler.session == stream.session
            if stream.chunks == 0 and not stream.cancelling and same_session:
                self._retry(stream, error)
                continue
            enqueued = stream.enqueued
            self._complete(stream, error.code)
            if enqueued:
                self._scheduler.cancel(stream.request_id)  # if its scheduler re-queued it already
            self._fail(stream, error)

    # ---- internals -------------------------------------------------------------------

    def _accept(self, stream: _Stream, reply: model_pool_pb2.GenerateReply) -> None:
        if reply.WhichOneof("kind") == "progress":
            if stream.expected == 0:  # outside the ordered stream; meaningless once it began
                self._tell_waiting(stream, Waiting(queued_ahead=reply.progress.queued_ahead))
            return
        if reply.sequence != stream.expected:
            what = "repeated" if reply.sequence < stream.expected else "missing"
            raise InternalError(
                f"stream broken: got reply {reply.sequence}, expected {stream.expected} ({what} replies)"
            )
        stream.expected += 1
        kind = reply.WhichOneof("kind")
        now = self._clock.monotonic()
        labels = {"model": stream.model_id}
        if kind == "chunk":
            if stream.chunks == 0:
                self._telemetry.record("time_to_first_token_ms", (now - stream.received) * 1e3, labels)
            else:
                self._telemetry.record("inter_token_latency_ms", (now - stream.last_chunk) * 1e3, labels)
            stream.chunks += 1
            stream.last_chunk = now
            if stream.cancelling:
                return
            if stream.events.qsize() >= MAX_BUFFERED:
                self._send_cancel(stream, "the client reads too slowly")
                self._deliver(stream, UnavailableError("the client read the stream too slowly"))
                return
            self._deliver(stream, chunk_event(reply.chunk))
            return
        if kind == "result":
            usage = reply.result.usage
            self._complete(stream, 0, inference_ms=(now - stream.received) * 1e3)
            self._deliver(
                stream,
                Finished(
                    _FINISH.get(reply.result.finish_reason, "stop"),
                    prompt_tokens=usage.prompt_tokens,
                    completion_tokens=usage.completion_tokens,
                    model=stream.model_id,
                    choices=tuple(
                        ChoiceEnd(end.index, _FINISH.get(end.finish_reason, "stop"), end.completion_tokens)
                        for end in reply.result.choices
                    ),
                ),
            )
            self._forget(stream)
            return
        if kind == "error":
            error = error_for_code(reply.error.error_code, reply.error.error_message)
            if reply.error.retryable and stream.chunks == 0 and not stream.cancelling:
                self._retry(stream, error)
                return
            self._complete(stream, error.code)
            self._fail(stream, error)
            return
        if kind == "cancelled":
            self._complete(stream, errors_pb2.ERROR_CODE_CANCELLED)
            self._fail(
                stream, UnavailableError(f"the worker stopped the generation ({reply.cancelled.reason})")
            )
            return
        raise InternalError(f"stream broken: reply {reply.sequence} carries nothing")

    # ---- where waiting streams stand -------------------------------------------------

    def _tell_waiting(self, stream: _Stream, waiting: Waiting) -> None:
        stream.waiting_told, stream.waiting_at = waiting, self._clock.monotonic()
        self._deliver(stream, waiting)

    def _watch_waiting(self) -> None:
        if self._waiting_task is None or self._waiting_task.done():
            self._waiting_task = asyncio.create_task(self._waiting_loop(), name="generation-waiting")

    async def _waiting_loop(self) -> None:
        """While streams wait for a grant: tell each where it stands (ends with the last stream)."""
        while self._streams:
            await asyncio.sleep(WAITING_FIRST_S / 2)
            try:
                await self._tell_ungranted(self._clock.monotonic())
            except Exception:
                log.exception("telling waiting generations where they stand failed")

    async def _tell_ungranted(self, now: float) -> None:
        ungranted: dict[str, list[_Stream]] = {}
        for stream in self._streams.values():  # in the order they were opened
            if not stream.worker_id and not stream.done and not stream.cancelling:
                ungranted.setdefault(stream.model_id, []).append(stream)
        for model_id, streams in ungranted.items():
            due = [
                (ahead, stream)
                for ahead, stream in enumerate(streams)
                if now - stream.received >= WAITING_FIRST_S
                and (stream.waiting_told is None or now - stream.waiting_at >= WAITING_EVERY_S)
            ]
            if not due:
                continue
            view = await self.model_view(model_id) if self.model_view is not None else None
            for ahead, stream in due:
                if stream.worker_id or stream.done:  # granted or ended while the view was read
                    continue
                waiting = _waiting(view, ahead, now_unix_ms=self._clock.time() * 1000)
                if waiting != stream.waiting_told:
                    self._tell_waiting(stream, waiting)

    def _retry(self, stream: _Stream, error: LoadmasterError) -> None:
        """Before its first chunk, a retryable failure tries again: a placed stream on another
        worker that serves its model, else through the scheduler (re-granted or rejected)."""
        worker_id = stream.worker_id
        self._telemetry.record("dispatch_retries", 1, {"model": stream.model_id})
        if stream.placed:
            self._unplace(stream)
            stream.tried.add(worker_id)
            stream.worker_id, stream.endpoint, stream.expected = "", "", 0
            if not self._place(stream):
                self._enqueue(stream)
            return
        stream.worker_id, stream.endpoint, stream.expected = "", "", 0
        self._scheduler.complete(
            stream.request_id, error_code=error.code, retryable=True, worker_id=worker_id
        )

    def _cancel(self, stream: _Stream, reason: str) -> None:
        """The consumer left: free the queue place or the sequence."""
        if stream.done or stream.cancelling:
            return
        stream.cancelling = True
        if not stream.worker_id:
            if stream.enqueued:
                self._scheduler.cancel(stream.request_id)
            self._forget(stream)
            return
        self._send_cancel(stream, reason)
        loop = asyncio.get_running_loop()
        stream.cancel_timer = loop.call_later(CANCEL_GRACE_S, self._cancel_overdue, stream)

    def _cancel_overdue(self, stream: _Stream) -> None:
        if self._streams.get(stream.request_id) is stream:
            log.warning("worker %s never ended cancelled generation %s", stream.worker_id, stream.request_id)
            self._complete(stream, errors_pb2.ERROR_CODE_CANCELLED)
            self._forget(stream)

    def _send_cancel(self, stream: _Stream, reason: str) -> None:
        message = model_pool_pb2.CancelGeneration(
            request_id=stream.request_id, model_id=stream.model_id, reason=reason
        )
        if (credentials := internal_auth.current()) is not None:
            credentials.sign_envelope(message.metadata, CANCEL_PREFIX + stream.request_id)
        with contextlib.suppress(UnavailableError):  # the link is gone: on_worker_lost follows
            self._workers.send_generation(stream.endpoint, GENERATE_CANCEL_FRAME, message.SerializeToString())

    def _complete(self, stream: _Stream, error_code: int, *, inference_ms: float = 0.0) -> None:
        if stream.placed:  # never queued at the scheduler: nothing to tell it
            self._unplace(stream)
            stream.worker_id = ""
            return
        if stream.worker_id:
            self._scheduler.complete(
                stream.request_id,
                error_code=error_code,
                worker_id=stream.worker_id,
                inference_ms=inference_ms,
            )
            stream.worker_id = ""

    def _deliver(self, stream: _Stream, item: GenerationEvent | BaseException) -> None:
        if not stream.cancelling:
            stream.events.put_nowait(item)

    def _fail(self, stream: _Stream, error: BaseException) -> None:
        self._deliver(stream, error)
        self._forget(stream)

    def _forget(self, stream: _Stream) -> None:
        self._unplace(stream)
        stream.done = True
        if stream.cancel_timer is not None:
            stream.cancel_timer.cancel()
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        self._drain.left(self._streams)


def _waiting(view: ModelView | None, ahead: int, *, now_unix_ms: float) -> Waiting:
    """A stream not granted yet: its model loading, else the streams ahead of it here."""
    if view is None or view.state != "LOADING":
        return Waiting(queued_ahead=ahead)
    if view.load_time_ms <= 0 or not view.load_started_unix_ms:
        return Waiting(loading=True)
    fraction = max(0.0, now_unix_ms - view.load_started_unix_ms) / view.load_time_ms
    return Waiting(loading=True, load_fraction=min(0.99, fraction))


def _message(
    request: GenerationRequest, *, request_id: str, default_max_tokens: int
) -> model_pool_pb2.GenerateRequest:
    sampling = model_pool_pb2.SamplingParams(
        max_tokens=request.max_tokens or default_max_tokens, stop=list(request.stop)
    )
    if request.temperature is not None:
        sampling.temperature = request.temperature
    if request.top_p is not None:
        sampling.top_p = request.top_p
    if request.seed is not None:
        sampling.seed = request.seed
    message = model_pool_pb2.GenerateRequest(
        request_id=request_id,
        model_id=request.model,
        sampling=sampling,
        priority=DEFAULT_PRIORITY if request.priority is None else request.priority,
    )
    if request.keep_alive_s is not None:
        message.keep_alive_s = request.keep_alive_s
    if request.messages is not None:
        message.messages.messages.extend(_turn(turn) for turn in request.messages)
        for image in request.images:  # fetched and checked by the front end (chat_images.py)
            message.messages.messages[image.message].images.append(image.data)
    else:
        message.prompt_text = request.prompt or ""
    if request.chat_template_kwargs:
        message.chat_template_kwargs = json.dumps(request.chat_template_kwargs, separators=(",", ":"))
    _response_format(message.response_format, request.response_format)
    if request.tools is not None:
        _tools(message.tools, request.tools)
    if request.logprobs is not None:
        message.logprobs.enabled = True
        message.logprobs.top = request.logprobs
    if request.n > 1:
        message.n = request.n
    return message


def _turn(turn: ChatTurn) -> model_pool_pb2.ChatMessage:
    return model_pool_pb2.ChatMessage(
        role="system" if turn.role == "developer" else turn.role,
        content=turn.content,
        tool_calls=[
            model_pool_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments, index=c.index)
            for c in turn.tool_calls
        ],
        tool_call_id=turn.tool_call_id,
        name=turn.name,
    )


def _tools(wire: model_pool_pb2.ToolUse, tools: ToolUse) -> None:
    wire.choice = tools.choice
    wire.function_name = tools.function_name
    wire.parallel = tools.parallel
    wire.functions.extend(
        model_pool_pb2.FunctionTool(
            name=f.name,
            description=f.description,
            parameters_json="" if f.parameters is None else json.dumps(f.parameters, separators=(",", ":")),
            strict=f.strict,
        )
        for f in tools.functions
    )


def chunk_event(chunk: model_pool_pb2.TokenChunk) -> TextChunk:
    """A worker's chunk as the front ends' event: its text, choice, calls and log probabilities."""
    return TextChunk(
        chunk.text,
        choice=chunk.choice,
        tool_calls=tuple(ToolCall(c.id, c.name, c.arguments, c.index) for c in chunk.tool_calls),
        logprobs=tuple(_logprob(item) for item in chunk.logprobs),
    )


def _logprob(item: model_pool_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(
        token=item.token.decode("utf-8", errors="replace"),
        bytes=item.token,
        logprob=item.logprob,
        top=tuple(
            TopLogprob(t.token.decode("utf-8", errors="replace"), t.token, t.logprob) for t in item.top
        ),
    )


def join_chunks(first: TextChunk, second: TextChunk) -> TextChunk:
    """Two chunks of one choice as one."""
    return dataclasses.replace(
        first,
        text=first.text + second.text,
        tool_calls=first.tool_calls + second.tool_calls,
        logprobs=first.logprobs + second.logprobs,
    )


def _response_format(wire: model_pool_pb2.ResponseFormat, value: dict[str, Any] | None) -> None:
    """OpenAI's `response_format` (checked by the schema) onto the worker's request."""
    kind = (value or {}).get("type")
    if kind not in ("json_object", "json_schema"):
        return
    assert value is not None
    wire.type = kind
    if kind == "json_schema":
        spec = value["json_schema"]
        wire.json_schema = json.dumps(spec["schema"], separators=(",", ":"))
        wire.name = str(spec.get("name") or "")


class GenerationRouter:
    """What the OpenAI routes need (`frontends.openai.Generations`): streams, and the
    generative models (backend transformers) with their state, from the catalog.

    A request for an alias (`models.aliases`, gateway/ladders.py) goes to the model its ladder
    picks: the stream runs under that model's id, and every event names it (`model`). Remote
    rungs are fallbacks only while `allow_cloud_fallback()` (asked per request) is true."""

    def __init__(
        self,
        streams: GenerationStreams,
        models: Callable[[], Awaitable[dict[str, ModelView]]],
        *,
        ladders: Mapping[str, Ladder] | None = None,
        clock: Clock | None = None,
        allow_cloud_fallback: Callable[[], bool] = lambda: True,
    ) -> None:
        self._streams = streams
        self._models = models
        self._remote: frozenset[str] = frozenset()  # remote rungs, as of the last look
        self._router = LadderRouter(
            ladders or {},
            self._states,
            clock=clock,
            remote=lambda: self._remote,
            allow_cloud_fallback=allow_cloud_fallback,
        )

    def set_ladders(self, ladders: Mapping[str, Ladder]) -> None:
        """Route aliases by `ladders` from now on (the admin plane changes them at run time)."""
        self._router.ladders = dict(ladders)

    def generate(
        self, request: GenerationRequest, *, request_id: str, client_id: str, tenant: str = ""
    ) -> AsyncIterator[GenerationEvent]:
        if self._router.is_alias(request.model):
            return self._routed(request, request_id=request_id, client_id=client_id, tenant=tenant)
        return self._streams.generate(request, request_id=request_id, client_id=client_id, tenant=tenant)

    async def _routed(
        self, request: GenerationRequest, *, request_id: str, client_id: str, tenant: str
    ) -> AsyncIterator[GenerationEvent]:
        model = await self._router.route(request.model)
        routed = dataclasses.replace(request, model=model)
        events = self._streams.generate(routed, request_id=request_id, client_id=client_id, tenant=tenant)
        async with contextlib.aclosing(events):  # closing this one cancels the stream at once
            async for item in events:
                yield dataclasses.replace(item, model=model) if isinstance(item, TextChunk) else item

    async def _states(self) -> dict[str, str]:
        return self._seen(await self._models())

    def _seen(self, views: Mapping[str, ModelView]) -> dict[str, str]:
        self._remote = frozenset(name for name, view in views.items() if view.backend in REMOTE_BACKENDS)
        return {name: view.state for name, view in views.items()}

    async def models(self) -> dict[str, str]:
        views = await self._models()
        self._router.observe(self._seen(views))
        served = {
            name: "IDLE" if view.state == "UNAVAILABLE" and view.reason in ("", "not loaded") else view.state
            for name, view in views.items()
            if view.backend in OPENAI_BACKENDS
        }
        return {**served, **alias_states(self._router.ladders, served, skip=self._router.skipped())}
