"""The worker's ZMQ data port: a ROUTER that answers InferRequests and runs generation streams.

    in   [identity, b"", InferRequest, payload]
    out  [identity, b"", InferReply, payload]      (payloads >= 64 KiB sent with copy=False)

Generation streams share the socket; their second frame names the message instead of being
empty (`GENERATE_*_FRAME` in loadmaster.common.framing) and `GenerationPort` runs them.

Input tensors are zero-copy views of the received payload frame. Every failure is a
reply (invalid tensors, unknown model, model not ready, expired, engine errors);
nothing a client sends stops the receive loop, and a slow model never holds up
another model's replies (each model has its own batcher and threads).

A request may instead name a slot of its gateway's shared memory (`InferRequest.shm`,
payload frame empty; see loadmaster.common.shm); its tensors are then views of the slot.
Regions are mapped read-only by name, only names a gateway gives its region are opened,
and a slot must lie inside its region: a bad reference is answered `invalid_argument`.
A region this worker cannot map (another host or user) is answered retryable with
`shm_unusable`, and the gateway sends this worker's payloads on the socket from then on.

The path costs per wake-up, not per message, because once batching removes most of
the engine time per request this overhead is what limits throughput (see
bench/model_pool_batching.py). The socket is a plain (blocking-API) ZMQ socket whose
file descriptor the event loop watches: each wake-up receives every waiting message
with NOBLOCK, decodes and admits each one straight into the pool (so a burst reaches
the batcher whole and runs as one batch), and replies are encoded from the batch's
completion callback without a Task, Future or await per request. The replies of one
engine call share one encoded envelope (`wire.ResultEncoder`: only the request id and
queue time differ) and are queued, then sent back to back once the callbacks of the
batch are over (`_flush`, the next loop turn), so ZMQ's I/O thread is woken once for
them instead of once per reply. A request counts as pending until its reply is sent.
ROUTER sends never block (a reply to a vanished peer is dropped), so sending from the
loop is safe.

Large inputs (64 KiB and more) and BYTES tensors (checked element by element) are decoded on
the port's one decoding thread, not on the loop: the loop also answers other requests, and a
60 MB BYTES observation took seconds to check. Compressed images (JPEG/PNG tensors, and BYTES
inputs a model declares as images) are decoded on the image threads (`image_threads`, a few:
libjpeg-turbo and zlib release the GIL, so eight camera frames decode side by side); a request
whose images take longer than `image_decode_ms` to decode is answered `invalid_argument` naming
the tensor, and its late result is dropped (images.py bounds the work itself: pixels, scans).
Requests of a model whose earlier request is still being decoded follow it (`_off_loop`, one
queue per model, admitted from its head as they finish), so a model's requests reach the pool
in the order they arrived. The decoding queues are bounded by `max_pending` like the rest.

A gateway on this host may instead reach the port over its local link, a Unix socket in the
abstract namespace named after the port (loadmaster.common.local_link: ~80 us less per call than
ZMQ). Its messages are the same frames; each link gets an identity of its own shape
(`local-N`), so replies find their way back by identity whichever link brought the request.

Receiving is `loadmaster.common.framing.SocketReader` (shared with the gateway): ZMQ's
descriptor is edge-triggered and a send may consume the signal of a message that arrived
meanwhile, so after each flush the port tells the reader, which looks at the socket again
(once per loop turn, however many replies went out in it).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import zmq
from google.protobuf.message import DecodeError
from opentelemetry.trace import SpanKind

from loadmaster.common import internal_auth, tracing, transport
from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.credentials import ENVELOPE_KEY
from loadmaster.common.errors import (
    InvalidArgumentError,
    UnauthenticatedError,
    UnavailableError,
    edge_code_name,
)
from loadmaster.common.framing import (
    GENERATE_CANCEL_FRAME,
    GENERATE_REPLIES_FRAME,
    GENERATE_REQUEST_FRAME,
    SocketReader,
    receive_routed,
    split_router_frames,
)
from loadmaster.common.local_link import FrameSocket, LocalListener, local_name
from loadmaster.common.shm import ShmRegions, ShmUnavailableError
from loadmaster.common.tensors import TensorLimits, decode_tensors, has_images
from loadmaster.model_pool.generation_port import GenerationPort
from loadmaster.model_pool.images import (
    DEFAULT_IMAGE_LIMITS,
    ImageDecoder,
    ImageLimits,
    decode_request,
    gpu_jpeg_decoder,
)
from loadmaster.model_pool.pool import InferResult, ModelPool
from loadmaster.model_pool.wire import (
    ResultEncoder,
    decode_off_loop,
    encode_off_loop,
    error_reply,
    failure_reply,
    result_reply,
)
from loadmaster.v1 import model_pool_pb2

__all__ = ["DataPort", "advertised_endpoint"]

log = logging.getLogger(__name__)

_DEFAULT_LIMITS = TensorLimits()
_WILDCARD_HOSTS = {"0.0.0.0", "*", "::", "[::]", ""}
_ZERO_COPY_BYTES = 64 << 10
# Plain ints: pyzmq's flag enums cost microseconds per `|` on this path.
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
# Messages taken per wake-up before yielding to the loop (replies, timers, gRPC), so a
# flood of requests cannot starve the rest of the worker.
_BURST = 256
_GENERATION_FRAMES = frozenset({GENERATE_REQUEST_FRAME, GENERATE_CANCEL_FRAME})
_BYTES = 9  # tensor_pb2.DTYPE_BYTES, as a plain int
_PENDING: Any = object()  # an off-loop decode's outcome before it is known


@dataclass(slots=True)
class _OffLoop:
    """A request being decoded off the loop; admitted once it and those ahead of it are done."""

    request: model_pool_pb2.InferRequest
    done: Any
    received: float
    outcome: Any = _PENDING  # the inputs, or the error that answers the request
    started: float = 0.0  # when its decoding thread took it (0: still waiting for one)
    image: str = ""  # the image it is decoding, for the time limit's error


def advertised_endpoint(
    last_endpoint: str, *, configured: str | None = None, hostname: str | None = None
) -> str:
    """How other processes reach a socket bound at `last_endpoint` (ZMQ's LAST_ENDPOINT).

    An explicit `configured` endpoint wins; a wildcard host (0.0.0.0, ::) becomes this
    machine's host name, which is what containers on one network resolve.
    """
    if configured:
        return configured
    if not last_endpoint.startswith("tcp://"):
        return last_endpoint  # ipc://, inproc:// name themselves
    rest = last_endpoint[len("tcp://") :]
    host, _, port = rest.rpartition(":")
    if host in _WILDCARD_HOSTS:
        host = hostname or socket.gethostname()
    return f"tcp://{host}:{port}"


def _peer(frames: list[Any]) -> str:
    """The sender's address (ZMQ's Peer-Address of a received frame), for refusal logs."""
    if len(frames) == 1:  # a local link's identity
        return f"local link {bytes(frames[0]).decode(errors='replace')}"
    for frame in frames[1:]:
        if isinstance(frame, zmq.Frame):
            try:
                return f"{frame.get('Peer-Address')} (zmq identity {bytes(frames[0]).hex()})"
            except (zmq.ZMQError, TypeError, ValueError):
                break
    return f"zmq identity {bytes(frames[0]).hex()}" if frames else ""


class DataPort:
    def __init__(
        self,
        pool: ModelPool,
        *,
        bind: str,
        worker_id: str,
        limits: TensorLimits = _DEFAULT_LIMITS,
        clock: Clock | None = None,
        max_pending: int = 10_000,
        hwm: int = 10_000,
        metrics: Any = None,
        image_limits: ImageLimits = DEFAULT_IMAGE_LIMITS,
        image_threads: int = 2,
        image_decode_ms: float = 250.0,
        local_link: bool = True,
    ) -> None:
        self._pool = pool
        self._bind = bind
        self._worker_id = worker_id
        self._limits = limits
        self._clock = clock or SystemClock()
        self._max_pending = max_pending
        self._hwm = hwm
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._socket: zmq.Socket[bytes] | None = None
        self._reader: SocketReader | None = None
        # Gateways on this host (loadmaster.common.local_link), by the identity their messages
        # carry here (never a ZMQ identity's shape).
        self._local_link = local_link
        self._listener: LocalListener | None = None
        self._peers: dict[bytes, FrameSocket] = {}
        self._regions = ShmRegions()
        self._pending = 0  # admitted requests whose reply is not sent yet
        # Replies waiting to be sent: (identity, envelope, payload, whether it answers an admitted request).
        self._outbox: list[tuple[bytes, bytes, Any, bool]] = []
        self._flush_scheduled = False
        self._encoder = ResultEncoder(worker_id)
        self._credentials = internal_auth.current()  # None: messages carry no credential to check
        self._settled = asyncio.Event()  # set while nothing is pending
        self._settled.set()
        self._decoder: ThreadPoolExecutor | None = None  # large inputs are decoded here
        self._image_pool: ThreadPoolExecutor | None = None  # compressed images are decoded here
        self._image_threads = image_threads
        self._image_limits = image_limits
        self._image_decode_s = image_decode_ms / 1000.0
        self._image_decoders: dict[str, ImageDecoder] = {}  # per device
        self._off_loop: dict[str, deque[_OffLoop]] = {}  # model -> its requests being decoded, in order
        self.last_endpoint = ""
        self.generations = GenerationPort(
            pool, worker_id=worker_id, send=self._send_replies, clock=self._clock, metrics=metrics
        )

    async def start(self) -> str:
        """Bind and start answering; returns ZMQ's LAST_ENDPOINT (the real port of a `:*` bind)."""
        self._loop = asyncio.get_running_loop()
        internal_auth.check_listen("model-pool data port", self._bind)
        self._context = zmq.Context()
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.RCVHWM, self._hwm)
        sock.setsockopt(zmq.SNDHWM, self._hwm)
        sock.setsockopt(zmq.LINGER, 1000)
        transport.apply_curve_server(sock)  # CurveZMQ when internal_auth.data_port_curve
        try:
            sock.bind(self._bind)
        except zmq.ZMQError as error:
            sock.close(linger=0)
            self._context.term()
            self._context = None
            raise RuntimeError(f"data port: cannot bind {self._bind}: {error}") from error
        self._socket = sock
        self.last_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._reader = SocketReader(
            sock,
            self._handle,
            name="data port",
            burst=_BURST,
            receive=receive_routed,
        )
        self._reader.start()
        log.info("data port bound on %s", self.last_endpoint)
        self._listen_locally()
        return self.last_endpoint

    def _listen_locally(self) -> None:
        """Gateways on this host reach the port over a Unix socket too (local_link.py)."""
        name = local_name(self.last_endpoint) if self._local_link else None
        if name is None or transport.current().curve_public:
            return  # a Unix socket has no CURVE handshake: with CURVE on, ZMQ only
        try:
            self._listener = LocalListener(name, self._local_message)
        except OSError as error:
            log.warning("data port: no local link on %r (%s); gateways here use ZMQ", name[1:], error)
            return
        self._peers = self._listener.peers
        log.info("data port also listens for gateways on this host on @%s", name[1:])

    def _local_message(self, identity: bytes, frames: list[memoryview]) -> None:
        if len(frames) == 3 and not len(frames[0]):
            self._request(identity, frames[1], frames[2], [identity])
        elif len(frames) == 2 and (kind := bytes(frames[0])) in _GENERATION_FRAMES:
            self.generations.handle(identity, kind, frames[1])
        else:
            error = InvalidArgumentError(f"a local-link message of {len(frames)} frames")
            self._reply(identity, error_reply(error, worker_id=self._worker_id))

    async def stop(self, *, timeout_s: float = 5.0) -> None:
        """Stop receiving, let replies in progress go out (bounded), close the socket."""
        if self._reader is not None:
            self._reader.stop()
        if self._listener is not None:
            self._listener.stop_reading()
        await self.generations.close()
        if self._pending:
            try:
                await asyncio.wait_for(self._settled.wait(), timeout_s)
            except TimeoutError:
                log.warning("data port closing with %d request(s) unanswered", self._pending)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._context is not None:
            self._context.term()
            self._context = None
        for executor in (self._decoder, self._image_pool):
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)
        self._decoder = self._image_pool = None
        self._regions.close()

    # ---- receiving -----------------------------------------------------------

    def _handle(self, frames: list[Any]) -> None:
        """One message on the ZMQ socket."""
        if len(frames) == 4 and not len(frames[1]):  # the usual shape, without building a RouterFrames
            identity = frames[0]  # bytes (receive_routed)
            envelope, payload = frames[2].buffer, frames[3].buffer
        else:
            if len(frames) == 3 and len(frames[1]) and (kind := frames[1].bytes) in _GENERATION_FRAMES:
                identity = frames[0] if isinstance(frames[0], bytes) else frames[0].bytes
                self.generations.handle(identity, kind, frames[2].buffer)
                return
            try:
                split = split_router_frames(frames)
            except InvalidArgumentError as error:
                if frames:
                    self._reply(frames[0], error_reply(error, worker_id=self._worker_id))
                return
            identity, envelope = split.identity, split.envelope.buffer
            payload = split.payload.buffer if isinstance(split.payload, zmq.Frame) else split.payload
        self._request(identity, envelope, payload, frames)

    def _request(self, identity: bytes, envelope: Any, payload: Any, frames: list[Any]) -> None:
        """One InferRequest, from either link (`frames`: the message, for refusal logs)."""
        received = self._clock.monotonic()
        request = model_pool_pb2.InferRequest()
        try:
            request.ParseFromString(envelope)
        except (DecodeError, TypeError, ValueError) as error:
            reply = error_reply(
                InvalidArgumentError(f"envelope is not an InferRequest: {error}"), worker_id=self._worker_id
            )
            self._reply(identity, reply)
            return
        request_id, model_id = request.request_id, request.model_id
        if self._credentials is not None and not self._authenticated(request, frames):
            refused = UnauthenticatedError("data-port message without a valid internal credential")
            self._reply(identity, self._failed(refused, request_id, model_id))
            return
        if self._pending >= self._max_pending:
            overloaded = UnavailableError("worker overloaded: too many pending requests")
            self._reply(identity, self._failed(overloaded, request_id, model_id))
            return
        # The worker's span of this request, parented on the gateway's (context in the metadata).
        span = (
            tracing.start_request_span(
                "model_pool.infer",
                request_id=request_id,
                model_id=model_id,
                carrier=request.metadata,
                kind=SpanKind.SERVER,
            )
            if tracing.enabled()
            else None
        )

        done = functools.partial(self._answer, identity, request_id, model_id, span)
        if not self._pending:
            self._settled.clear()
        self._pending += 1
        try:
            if request.HasField("shm"):
                payload = self._shm_payload(request.shm, payload)
            if model_id in self._off_loop or decode_off_loop(request.inputs, payload):
                self._decode_off_loop(request, payload, done, received)
                return
            inputs = decode_tensors(request.inputs, payload, self._limits)
            self._admit(request, inputs, done, received)
        except Exception as error:  # refused at the door: answered now
            done(error)

    def _admit(self, request: model_pool_pb2.InferRequest, inputs: Any, done: Any, received: float) -> None:
        self._pool.submit(
            request.model_id,
            inputs,
            done=done,
            deadline_unix_ns=request.deadline_unix_ns,
            received_monotonic=received,
            front=request.front_of_queue,
        )

    def _decode_off_loop(
        self, request: model_pool_pb2.InferRequest, payload: Any, done: Any, received: float
    ) -> None:
        """Decode on a thread: compressed images on the image threads (with the time limit),
        anything else on the one decoding thread; admitted in arrival order per model."""
        loop = self._loop
        assert loop is not None
        model_id = request.model_id
        entry = _OffLoop(request, done, received)
        declared: dict[str, tuple[int, ...] | None] = {}
        images = has_images(request.inputs)
        if not images and any(desc.dtype == _BYTES for desc in request.inputs):
            declared, _ = self._pool.image_inputs(model_id)  # BYTES the model takes as images
            images = any(desc.key in declared for desc in request.inputs)
        if images:
            decoder = self._image_decoder(self._pool.image_device(model_id))
            executor = self._image_pool
            if executor is None:
                executor = self._image_pool = ThreadPoolExecutor(
                    max_workers=self._image_threads, thread_name_prefix="data-port-images"
                )

            def named(key: str) -> None:
                entry.image = key

            def decode() -> Any:
                return decode_request(
                    request.inputs, payload, self._limits, decoder, declared=declared, on_tensor=named
                )
        else:
            if self._decoder is None:
                self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="data-port-decode")
            executor = self._decoder

            def decode() -> Any:
                return decode_tensors(request.inputs, payload, self._limits)

        def run() -> None:  # on the thread
            entry.started = self._clock.monotonic()
            try:
                outcome: Any = decode()
            except Exception as error:
                outcome = error
            try:
                loop.call_soon_threadsafe(self._decoded, entry, outcome)
            except RuntimeError:
                pass  # the loop closed: nobody is left to answer

        self._off_loop.setdefault(model_id, deque()).append(entry)
        executor.submit(run)
        if images:
            loop.call_later(self._image_decode_s, self._check_decode_time, entry)

    def _image_decoder(self, device: str) -> ImageDecoder:
        decoder = self._image_decoders.get(device)
        if decoder is None:
            decoder = self._image_decoders[device] = ImageDecoder(
                self._image_limits, gpu_jpeg=gpu_jpeg_decoder(device)
            )
        return decoder

    def _check_decode_time(self, entry: _OffLoop) -> None:
        """On the loop, `image_decode_ms` after a request went to the image threads (and again
        while it waits for one): a decode running longer than that answers the request."""
        if entry.outcome is not _PENDING:
            return
        assert self._loop is not None
        left = self._image_decode_s - (self._clock.monotonic() - entry.started) if entry.started else 0.0
        if not entry.started or left > 0:
            self._loop.call_later(left or self._image_decode_s, self._check_decode_time, entry)
            return
        limit_ms = self._image_decode_s * 1000.0
        what = f"tensor '{entry.image}'" if entry.image else "the request's images"
        self._decoded(
            entry, InvalidArgumentError(f"{what}: decoding took longer than the limit of {limit_ms:.0f} ms")
        )

    def _decoded(self, entry: _OffLoop, outcome: Any) -> None:
        """On the loop: a request decoded off the loop (or timed out) is done; admit (or answer)
        every finished request at the head of its model's queue."""
        if entry.outcome is not _PENDING:
            return  # answered when its decode ran past the limit; this is the late result
        entry.outcome = outcome
        model_id = entry.request.model_id
        queue = self._off_loop.get(model_id)
        while queue and queue[0].outcome is not _PENDING:
            head = queue.popleft()
            try:
                if isinstance(head.outcome, BaseException):
                    raise head.outcome
                self._admit(head.request, head.outcome, head.done, head.received)
            except Exception as error:
                head.done(error)
        if not queue:
            self._off_loop.pop(model_id, None)

    def _authenticated(self, request: model_pool_pb2.InferRequest, frames: list[Any]) -> bool:
        assert self._credentials is not None
        try:
            self._credentials.verify_envelope(request.metadata, request.request_id)
        except UnauthenticatedError as error:
            token = request.metadata.get(ENVELOPE_KEY, "")
            internal_auth.log_refusal(
                f"data-port request {request.request_id[:64]!r}",
                _peer(frames),
                token.partition(" ")[0],
                error.message,
            )
            return False
        return True

    def _shm_payload(self, ref: model_pool_pb2.ShmPayload, frame: Any) -> memoryview:
        if len(frame):
            raise InvalidArgumentError("shm: the payload frame must be empty when the payload is in shm")
        return self._regions.view(ref.region, ref.offset, ref.size)

    # ---- answering -----------------------------------------------------------

    def _failed(self, error: BaseException, request_id: str, model_id: str) -> model_pool_pb2.InferResponse:
        return failure_reply(error, request_id=request_id, model_id=model_id, worker_id=self._worker_id)

    def _answer(
        self,
        identity: bytes,
        request_id: str,
        model_id: str,
        span: Any,
        outcome: InferResult | BaseException,
    ) -> None:
        """Queue the reply of an admitted request (it counts as pending until it is sent)."""
        payload: Any = b""
        error_code = 0
        if isinstance(outcome, BaseException):
            reply = self._failed(outcome, request_id, model_id)
            reply.shm_unusable = isinstance(outcome, ShmUnavailableError)
            error_code = reply.error_code
            envelope = reply.SerializeToString()
        elif encode_off_loop(outcome.outputs):
            self._encode_off_loop(identity, request_id, model_id, span, outcome)
            return
        else:
            try:
                envelope, payload = self._encoder.encode(outcome, request_id=request_id, model_id=model_id)
            except Exception as error:  # outputs that cannot be encoded
                reply = self._failed(error, request_id, model_id)
                error_code = reply.error_code
                envelope = reply.SerializeToString()
        if span is not None:
            tracing.end_span(span, error_code=edge_code_name(error_code) if error_code else "")
        self._queue(identity, envelope, payload, admitted=True)

    def _encode_off_loop(
        self, identity: bytes, request_id: str, model_id: str, span: Any, result: InferResult
    ) -> None:
        """Encode large string outputs on the decoding thread, then queue the reply on the loop."""
        if self._decoder is None:
            self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="data-port-decode")
        loop = self._loop
        assert loop is not None

        def encode() -> None:  # on the decoding thread
            payload: Any = b""
            try:
                reply, payload = result_reply(
                    result, request_id=request_id, model_id=model_id, worker_id=self._worker_id
                )
            except Exception as error:  # outputs that cannot be encoded
                reply = self._failed(error, request_id, model_id)
            try:
                loop.call_soon_threadsafe(self._encoded, identity, span, reply, payload)
            except RuntimeError:
                pass  # the loop closed: nobody is left to answer

        self._decoder.submit(encode)

    def _encoded(self, identity: bytes, span: Any, reply: model_pool_pb2.InferResponse, payload: Any) -> None:
        """On the loop: a reply encoded on the decoding thread is queued."""
        if span is not None:
            tracing.end_span(span, error_code=edge_code_name(reply.error_code) if reply.error_code else "")
        self._queue(identity, reply.SerializeToString(), payload, admitted=True)

    def _reply(self, identity: bytes, reply: model_pool_pb2.InferResponse) -> None:
        """Queue the reply to a message that was never admitted (malformed, overloaded)."""
        self._queue(identity, reply.SerializeToString(), b"", admitted=False)

    def _queue(self, identity: bytes, envelope: bytes, payload: Any, *, admitted: bool) -> None:
        self._outbox.append((identity, envelope, payload, admitted))
        if not self._flush_scheduled:
            assert self._loop is not None  # set by start(), before any message
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Send every queued reply back to back: the replies of a batch leave in one go, so
        ZMQ's I/O thread is woken once for them rather than once per reply."""
        self._flush_scheduled = False
        outbox, self._outbox = self._outbox, []
        sock, peers = self._socket, self._peers
        corked: list[FrameSocket] = []
        for identity, envelope, payload, admitted in outbox:
            peer = peers.get(identity) if peers else None
            if peer is not None:
                peer.queue((b"", envelope, payload))
                corked.append(peer)
            elif sock is not None:
                self._send(sock, identity, envelope, payload)
            if admitted:
                self._pending -= 1
        for peer in corked:
            peer.flush()  # once per link: the rest find nothing queued
        if not self._pending:
            self._settled.set()
        if self._reader is not None:
            self._reader.sent()  # a send may have taken the descriptor's signal of a new message

    def _send_replies(self, identity: bytes, replies: bytes) -> None:
        """One GenerateReplies message to a gateway (never blocks: a ROUTER drops for a gone peer)."""
        peer = self._peers.get(identity) if self._peers else None
        if peer is not None:
            peer.send((GENERATE_REPLIES_FRAME, replies))
            return
        sock = self._socket
        if sock is None:
            return
        try:
            sock.send(identity, _MORE_NOBLOCK)
            sock.send(GENERATE_REPLIES_FRAME, _MORE_NOBLOCK)
            sock.send(replies, _NOBLOCK)
        except zmq.ZMQError as error:
            log.warning("data port could not send generation replies: %s", error)
        if self._reader is not None:
            self._reader.sent()

    def _send(self, sock: zmq.Socket[bytes], identity: bytes, envelope: bytes, payload: Any) -> None:
        try:
            # Zero-copy only pays for large payloads: below it pyzmq's Frame bookkeeping costs more
            # than the copy (measured: ~80 us per frame on the small-tensor path). Sized before the
            # first frame goes, so a bad payload cannot leave half a message on the socket.
            copy = memoryview(payload).nbytes < _ZERO_COPY_BYTES
            # Frame by frame with int flags: a third of what send_multipart costs per reply.
            # (Calling pyzmq's private zmq.backend.Socket.send, past the public wrapper, saved
            # only ~1-3 us per reply: not worth depending on pyzmq's internals.)
            sock.send(identity, _MORE_NOBLOCK)
            sock.send(b"", _MORE_NOBLOCK)
            sock.send(envelope, _MORE_NOBLOCK)
            sock.send(payload, _NOBLOCK, copy=copy)
        except (zmq.ZMQError, TypeError, ValueError) as error:
            log.warning("data port could not send a reply: %s", error)
