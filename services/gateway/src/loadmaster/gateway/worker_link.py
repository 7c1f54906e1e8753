"""Data-plane links to model-pool workers: one ZMQ DEALER per worker data endpoint.

Requests go out as `[b"", InferRequest, payload]` with the payload frame passed
through untouched (a received frame is forwarded without copying its data);
replies come back as `[b"", InferReply, payload]` and are handed to `on_reply`
with the payload frame, again without a copy. The sockets are plain ZMQ sockets
read straight from the event loop (`SocketReader`): no Future or task wake-up per
message, because on this path they cost more than the message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import zmq
from google.protobuf.message import DecodeError

from loadmaster.common.errors import UnavailableError
from loadmaster.common.framing import SocketReader, send_frames
from loadmaster.v1 import model_pool_pb2

__all__ = ["WorkerLinks"]

log = logging.getLogger(__name__)

ReplyHandler = Callable[[model_pool_pb2.InferReply, Any], None]


class WorkerLinks:
    def __init__(self, context: zmq.Context[Any], on_reply: ReplyHandler, *, send_hwm: int = 10_000) -> None:
        self._context = context
        self._on_reply = on_reply
        self._send_hwm = send_hwm
        self._links: dict[str, tuple[zmq.Socket[Any], SocketReader]] = {}

    def send(self, endpoint: str, envelope: bytes, payload: Any) -> None:
        """Queue one request for `endpoint`; raise `UnavailableError` when it cannot be queued."""
        socket, reader = self._links.get(endpoint) or self._connect(endpoint)
        try:
            send_frames(socket, (b"", envelope, payload))
        except zmq.Again:
            raise UnavailableError(f"worker data port {endpoint} is not accepting requests") from None
        except zmq.ZMQError as error:
            raise UnavailableError(f"worker data port {endpoint}: {error}") from None
        finally:
            reader.sent()

    def _connect(self, endpoint: str) -> tuple[zmq.Socket[Any], SocketReader]:
        socket: zmq.Socket[Any] = zmq.Socket(self._context, zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, self._send_hwm)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.connect(endpoint)
        reader = SocketReader(socket, partial(self._on_frames, endpoint), name=f"data link to {endpoint}")
        reader.start()
        link = self._links[endpoint] = (socket, reader)
        return link

    def _on_frames(self, endpoint: str, frames: list[zmq.Frame]) -> None:
        try:
            if len(frames) < 2:
                raise DecodeError(f"{len(frames)} frames")
            reply = model_pool_pb2.InferReply.FromString(frames[1].bytes)
        except DecodeError as error:
            log.error("malformed reply from worker %s: %s", endpoint, error)
            return
        self._on_reply(reply, frames[2] if len(frames) > 2 else b"")

    async def close(self) -> None:
        for socket, reader in self._links.values():
            reader.stop()
            socket.close(linger=0)
        self._links.clear()
