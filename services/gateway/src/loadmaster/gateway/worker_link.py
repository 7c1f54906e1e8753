"""Data-plane links to model-pool workers: one ZMQ DEALER per worker data endpoint.

Requests go out as `[b"", InferRequest, payload]` with the payload frame passed
through untouched (copy=False); replies come back as `[b"", InferReply, payload]`
and are handed to `on_reply` with the payload frame, again without a copy.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio
from google.protobuf.message import DecodeError

from loadmaster.common.errors import UnavailableError
from loadmaster.v1 import model_pool_pb2

__all__ = ["WorkerLinks"]

log = logging.getLogger(__name__)

ReplyHandler = Callable[[model_pool_pb2.InferReply, Any], None]


class WorkerLinks:
    def __init__(
        self, context: zmq.asyncio.Context, on_reply: ReplyHandler, *, send_hwm: int = 10_000
    ) -> None:
        self._context = context
        self._on_reply = on_reply
        self._send_hwm = send_hwm
        self._sockets: dict[str, zmq.asyncio.Socket] = {}
        self._readers: dict[str, asyncio.Task[None]] = {}

    def send(self, endpoint: str, envelope: bytes, payload: Any) -> None:
        """Queue one request for `endpoint`; raise `UnavailableError` when it cannot be queued."""
        socket = self._sockets.get(endpoint) or self._connect(endpoint)
        try:
            socket.send_multipart([b"", envelope, payload], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise UnavailableError(f"worker data port {endpoint} is not accepting requests") from None
        except zmq.ZMQError as error:
            raise UnavailableError(f"worker data port {endpoint}: {error}") from None

    def _connect(self, endpoint: str) -> zmq.asyncio.Socket:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, self._send_hwm)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.connect(endpoint)
        self._sockets[endpoint] = socket
        self._readers[endpoint] = asyncio.create_task(self._read(endpoint, socket), name=f"worker-{endpoint}")
        return socket

    async def _read(self, endpoint: str, socket: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await socket.recv_multipart(copy=False)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as error:
                log.warning("data link to %s closed: %s", endpoint, error)
                return
            try:
                if len(frames) < 2:
                    raise DecodeError(f"{len(frames)} frames")
                reply = model_pool_pb2.InferReply.FromString(frames[1].bytes)
                payload = frames[2] if len(frames) > 2 else b""
                self._on_reply(reply, payload)
            except DecodeError as error:
                log.error("malformed reply from worker %s: %s", endpoint, error)
            except Exception:
                log.exception("handling a reply from worker %s failed", endpoint)

    async def close(self) -> None:
        for task in self._readers.values():
            task.cancel()
        await asyncio.gather(*self._readers.values(), return_exceptions=True)
        for socket in self._sockets.values():
            socket.close(linger=0)
        self._sockets.clear()
        self._readers.clear()
