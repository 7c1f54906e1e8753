"""Envelope + payload framing shared by the ZMQ edge and the worker data plane.

Both use the same multipart layout on a ROUTER socket:
    incoming  [identity, b"", envelope, payload]
    outgoing  [identity, b"", envelope, payload]
The payload frame is optional on input (an observation without tensors).

`receive_frames` / `send_frames` move one message on a plain (blocking-API) socket
without blocking, and `SocketReader` runs a callback for every message from the
event loop, for paths where zmq.asyncio's Future and task wake-up per message cost
more than the message itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import zmq

from loadmaster.common.errors import InvalidArgumentError, LoadmasterError
from loadmaster.v1 import edge_pb2, tensor_pb2

__all__ = [
    "ERROR_CODE_KEY",
    "ERROR_KEY",
    "GENERATE_CANCEL_FRAME",
    "GENERATE_REPLIES_FRAME",
    "GENERATE_REQUEST_FRAME",
    "REQUEST_ID_KEY",
    "RouterFrames",
    "SocketReader",
    "edge_error_response",
    "receive_frames",
    "receive_routed",
    "router_reply",
    "send_frames",
    "split_router_frames",
]

log = logging.getLogger(__name__)

ERROR_KEY = "error"
ERROR_CODE_KEY = "error_code"
REQUEST_ID_KEY = "request_id"

# Generation streams on a worker's data port (model_pool.proto, docs/generative.md): the frame
# where a tensor request has its empty delimiter names the message instead, so one ROUTER
# socket carries both. Gateway -> worker: [kind, GenerateRequest | CancelGeneration];
# worker -> gateway: [GENERATE_REPLIES_FRAME, GenerateReplies]. A tensor request's is b"".
GENERATE_REQUEST_FRAME = b"lm.generate"
GENERATE_CANCEL_FRAME = b"lm.cancel"
GENERATE_REPLIES_FRAME = b"lm.replies"


@dataclass(frozen=True, slots=True)
class RouterFrames:
    identity: bytes
    envelope: Any  # zmq.Frame or bytes: only its buffer is read
    payload: Any


def split_router_frames(frames: Sequence[Any]) -> RouterFrames:
    """Split a ROUTER multipart message; raise `InvalidArgumentError` when malformed."""
    if len(frames) < 3:
        raise InvalidArgumentError(f"expected [identity, '', envelope, payload], got {len(frames)} frames")
    if len(frames) > 4:
        raise InvalidArgumentError(f"expected at most 4 frames, got {len(frames)}")
    if len(frames[1]) != 0:
        raise InvalidArgumentError("the frame after the identity must be empty")
    identity = frames[0].bytes if hasattr(frames[0], "bytes") else bytes(frames[0])
    payload = frames[3] if len(frames) == 4 else b""
    return RouterFrames(identity=identity, envelope=frames[2], payload=payload)


def router_reply(identity: bytes, envelope: bytes, payload: Any = b"") -> list[Any]:
    return [identity, b"", envelope, payload]


def edge_error_response(
    error: LoadmasterError,
    *,
    model_id: str,
    client: edge_pb2.Client | None = None,
    request_id: str = "",
) -> edge_pb2.ModelResponse:
    """A failure reply: no tensors, `metadata["error"]` and `metadata["error_code"]`."""
    response = edge_pb2.ModelResponse(
        response_id=request_id or uuid.uuid4().hex,
        timestamp_ns=time.time_ns(),
        model_id=model_id,
    )
    if client is not None:
        response.client.CopyFrom(client)
    response.metadata[ERROR_KEY] = error.message
    response.metadata[ERROR_CODE_KEY] = error.edge_code
    if request_id:
        response.metadata[REQUEST_ID_KEY] = request_id
    return response


# Plain ints: pyzmq's flag enums cost microseconds per `|` and `&` on a hot path.
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def _readable(socket: zmq.Socket[Any]) -> bool:
    """Whether a message is waiting (asking also re-arms the edge-triggered descriptor)."""
    return bool(cast(int, socket.getsockopt(_EVENTS)) & _POLLIN)


def receive_frames(socket: zmq.Socket[Any]) -> list[zmq.Frame]:
    """One whole message as zero-copy frames; raises zmq.Again when none is waiting.
    (Half the cost of recv_multipart: no RCVMORE getsockopt and no flag enums per frame.)"""
    frames = [socket.recv(_NOBLOCK, copy=False)]
    while frames[-1].more:  # the rest of a message is there once its first frame is
        frames.append(socket.recv(_NOBLOCK, copy=False))
    return frames


def receive_routed(socket: zmq.Socket[Any]) -> list[Any]:
    """`receive_frames` for a ROUTER: the same message, with the identity as bytes.

    A ROUTER's first frame is always followed by the sender's frames, so it needs no
    `more` flag, and bytes cost less to receive than a Frame (and than its `.bytes` later)."""
    frames: list[Any] = [socket.recv(_NOBLOCK)]
    frame = socket.recv(_NOBLOCK, copy=False)
    frames.append(frame)
    while frame.more:
        frame = socket.recv(_NOBLOCK, copy=False)
        frames.append(frame)
    return frames


def send_frames(socket: zmq.Socket[Any], frames: Sequence[Any]) -> None:
    """Queue one message without blocking; raises zmq.Again when it cannot be queued.

    Received `zmq.Frame`s are forwarded without copying their data; buffers of 64 KiB
    and more are sent zero-copy, smaller ones are copied (cheaper than tracking them).
    Only the first frame can meet the high-water mark, so a message goes out whole or not at all.
    """
    last = len(frames) - 1
    for index, frame in enumerate(frames):
        socket.send(frame, _MORE_NOBLOCK if index < last else _NOBLOCK, copy=False)


class SocketReader:
    """Calls `handle(frames)` for every message arriving on a plain ZMQ socket, from the loop.
    (`receive` takes one message off the socket: `receive_frames`, or `receive_routed` on a ROUTER.)

    The loop watches the socket's descriptor; each wake-up takes every waiting message
    (up to `burst`, then the rest after other callbacks had their turn), with no
    Future, Task or extra loop iteration per message, and no ZMQ_EVENTS query per
    message either (see `_drain`). ZMQ's descriptor is
    edge-triggered and a send on the socket may consume the signal of a message that
    arrived meanwhile, so whoever sends on it calls `sent()` afterwards.
    """

    def __init__(
        self,
        socket: zmq.Socket[Any],
        handle: Callable[[list[Any]], None],
        *,
        name: str,
        burst: int = 256,
        receive: Callable[[zmq.Socket[Any]], list[Any]] = receive_frames,
    ) -> None:
        self._socket = socket
        self._handle = handle
        self._receive = receive
        self._name = name
        self._burst = burst
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd: int | None = None  # watched by the loop while reading
        self._scheduled = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._fd = self._socket.fileno()
        self._loop.add_reader(self._fd, self._drain)
        self._schedule()  # what arrived before the loop watched the descriptor

    def stop(self) -> None:
        if self._loop is not None and self._fd is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._fd = None

    def sent(self) -> None:
        """After a send on the socket: read what arrived if the send took its signal.

        Only schedules one look for after the current callback (a batch's replies all go out
        in one callback): asking ZMQ_EVENTS costs microseconds each, so the sends of one
        wake-up share one check instead of paying one apiece."""
        if self._fd is not None:
            self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._drain, True)

    def _drain(self, ask_first: bool = False) -> None:
        """Take every waiting message, up to `burst`.

        Asking ZMQ_EVENTS costs a system call (and pyzmq an option lookup) each time; a receive
        that finds nothing raises zmq.Again, about twice that, but a receive that finds a
        message costs neither. So a wake-up of the descriptor receives straight away and every
        next message is received without asking first, ending at the one zmq.Again of the
        wake-up; only a look that may well find nothing (scheduled after a send, `ask_first`)
        asks first. Either way the last call leaves the descriptor re-armed."""
        if ask_first:
            self._scheduled = False
        socket, receive, handle = self._socket, self._receive, self._handle
        try:
            if ask_first and not _readable(socket):
                return
            for _ in range(self._burst):
                if self._fd is None:
                    return
                frames = receive(socket)  # zmq.Again once nothing is waiting
                try:
                    handle(frames)
                except Exception:
                    log.exception("%s: handling a message failed", self._name)
        except zmq.Again:
            return
        except zmq.ZMQError as error:
            if error.errno not in (zmq.ETERM, zmq.ENOTSOCK):
                log.warning("%s: receive failed: %s", self._name, error)
            self.stop()
            return
        self._schedule()  # more may be waiting: after the loop has run other work


# Re-exported for callers building descriptors by hand.
Tensor = tensor_pb2.Tensor
