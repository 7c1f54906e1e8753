"""The worker's ZMQ data port: a ROUTER that answers InferRequests.

    in   [identity, b"", InferRequest, payload]
    out  [identity, b"", InferReply, payload]      (payloads >= 64 KiB sent with copy=False)

Input tensors are zero-copy views of the received payload frame; each request runs
as its own task, so a slow model never holds up another model's replies. Every
failure is a reply (invalid tensors, unknown model, model not ready, expired,
engine errors); nothing a client sends stops the receive loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import zmq
import zmq.asyncio
from google.protobuf.message import DecodeError
from opentelemetry.trace import SpanKind

from loadmaster.common import tracing
from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.errors import InvalidArgumentError, LoadmasterError, UnavailableError, edge_code_name
from loadmaster.common.framing import router_reply, split_router_frames
from loadmaster.common.tensors import TensorLimits
from loadmaster.model_pool.pool import ModelPool
from loadmaster.model_pool.wire import error_reply, handle_infer
from loadmaster.v1 import model_pool_pb2

__all__ = ["DataPort", "advertised_endpoint"]

log = logging.getLogger(__name__)

_DEFAULT_LIMITS = TensorLimits()
_WILDCARD_HOSTS = {"0.0.0.0", "*", "::", "[::]", ""}


_ZERO_COPY_BYTES = 64 << 10


def _nbytes(payload: Any) -> int:
    try:
        return memoryview(payload).nbytes
    except TypeError:
        return len(payload)


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
    ) -> None:
        self._pool = pool
        self._bind = bind
        self._worker_id = worker_id
        self._limits = limits
        self._clock = clock or SystemClock()
        self._max_pending = max_pending
        self._hwm = hwm
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[None]] = set()
        self.last_endpoint = ""

    async def start(self) -> str:
        """Bind and start answering; returns ZMQ's LAST_ENDPOINT (the real port of a `:*` bind)."""
        self._context = zmq.asyncio.Context()
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.RCVHWM, self._hwm)
        sock.setsockopt(zmq.SNDHWM, self._hwm)
        sock.setsockopt(zmq.LINGER, 1000)
        try:
            sock.bind(self._bind)
        except zmq.ZMQError as error:
            sock.close(linger=0)
            self._context.term()
            self._context = None
            raise RuntimeError(f"data port: cannot bind {self._bind}: {error}") from error
        self._socket = sock
        self.last_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._receiver = asyncio.create_task(self._receive_loop(), name="data-port")
        log.info("data port bound on %s", self.last_endpoint)
        return self.last_endpoint

    async def stop(self, *, timeout_s: float = 5.0) -> None:
        """Stop receiving, let replies in progress go out (bounded), close the socket."""
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
            self._receiver = None
        if self._pending:
            _, late = await asyncio.wait(set(self._pending), timeout=timeout_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._context is not None:
            self._context.term()
            self._context = None

    async def _receive_loop(self) -> None:
        assert self._socket is not None
        while True:
            try:
                frames = await self._socket.recv_multipart(copy=False)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as error:
                if error.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                log.exception("data port receive failed")
                continue
            except Exception:
                log.exception("data port receive failed")
                continue
            try:
                self._dispatch(frames, self._clock.monotonic())
            except Exception:
                log.exception("data port dispatch failed")

    def _dispatch(self, frames: list[Any], received: float) -> None:
        if len(self._pending) >= self._max_pending:
            self._spawn(
                self._reply_error(frames, UnavailableError("worker overloaded: too many pending requests"))
            )
            return
        self._spawn(self._handle(frames, received))

    def _spawn(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self._pending.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("data port request failed", exc_info=task.exception())

    async def _reply_error(self, frames: list[Any], error: LoadmasterError) -> None:
        if not frames:
            return
        identity = frames[0].bytes if hasattr(frames[0], "bytes") else bytes(frames[0])
        await self._send(identity, error_reply(error, worker_id=self._worker_id), b"")

    async def _handle(self, frames: list[Any], received: float) -> None:
        try:
            split = split_router_frames(frames)
        except InvalidArgumentError as error:
            await self._reply_error(frames, error)
            return
        request = model_pool_pb2.InferRequest()
        try:
            request.ParseFromString(
                split.envelope.bytes if hasattr(split.envelope, "bytes") else split.envelope
            )
        except (DecodeError, TypeError, ValueError) as error:
            reply = error_reply(
                InvalidArgumentError(f"envelope is not an InferRequest: {error}"), worker_id=self._worker_id
            )
            await self._send(split.identity, reply, b"")
            return
        payload = split.payload.buffer if hasattr(split.payload, "buffer") else split.payload
        # The worker's span of this request, parented on the gateway's (context in the metadata).
        span = tracing.start_request_span(
            "model_pool.infer",
            request_id=request.request_id,
            model_id=request.model_id,
            carrier=request.metadata,
            kind=SpanKind.SERVER,
        )
        reply, out_payload = await handle_infer(
            self._pool,
            request,
            payload,
            worker_id=self._worker_id,
            limits=self._limits,
            received_monotonic=received,
        )
        tracing.end_span(span, error_code=edge_code_name(reply.error_code) if reply.error_code else "")
        await self._send(split.identity, reply, out_payload)

    async def _send(self, identity: bytes, reply: model_pool_pb2.InferReply, payload: Any) -> None:
        if self._socket is None:
            return
        try:
            # Zero-copy only pays for large payloads: below it pyzmq's Frame bookkeeping costs more
            # than the copy (measured: ~80 us per frame on the small-tensor path).
            copy = _nbytes(payload) < _ZERO_COPY_BYTES
            await self._socket.send_multipart(
                router_reply(identity, reply.SerializeToString(), payload), copy=copy
            )
        except (zmq.ZMQError, TypeError, ValueError) as error:
            log.warning("data port could not send reply %s: %s", reply.request_id, error)
