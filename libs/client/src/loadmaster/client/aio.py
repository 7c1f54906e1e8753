"""Asyncio client for the ZMQ edge protocol: the same shape as `Connection`, with awaits.

    async with AsyncConnection("tcp://127.0.0.1:5555") as conn:
        double = conn.model("double")
        out = await double.infer(x=np.arange(3, dtype=np.float32))

One reader task matches replies to requests by the request id carried in
metadata; a reply whose request already timed out is dropped, never returned
for another request. Many requests may be in flight at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from loadmaster.client._protocol import (
    CurveKeys,
    EdgeClient,
    NoReplyError,
    read_reply,
    reply_id,
    tensors_of,
)
from loadmaster.v1 import edge_pb2

__all__ = ["AsyncConnection", "AsyncModel"]

log = logging.getLogger(__name__)

_Reply = tuple[edge_pb2.ModelResponse, bytes]


class AsyncConnection(EdgeClient):
    def __init__(
        self,
        server: str = "tcp://127.0.0.1:5555",
        client_id: str | None = None,
        client_type: str = "",
        *,
        curve: CurveKeys | None = None,
    ) -> None:
        super().__init__(zmq.asyncio.Context(), server, client_id, client_type, curve)
        self._waiting: dict[str, asyncio.Future[_Reply]] = {}
        self._reader: asyncio.Task[None] | None = None

    def model(self, model_id: str, *, latency_budget_ms: float = 50.0, priority: int = 1) -> AsyncModel:
        return AsyncModel(self, model_id, latency_budget_ms=latency_budget_ms, priority=priority)

    def _send(
        self, observation: edge_pb2.Observation, payload: Any, request_id: str
    ) -> asyncio.Future[_Reply]:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read(), name="loadmaster-client-read")
        future: asyncio.Future[_Reply] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        self._socket.send_multipart([b"", observation.SerializeToString(), payload], copy=False)
        return future

    def _forget(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    async def _read(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            try:
                response = edge_pb2.ModelResponse.FromString(frames[1])
            except Exception:  # a malformed reply: nothing to match it to
                log.warning("dropped a malformed reply")
                continue
            future = self._waiting.pop(reply_id(response), None)
            if future is not None and not future.done():
                future.set_result((response, frames[2] if len(frames) > 2 else b""))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        for future in self._waiting.values():
            future.cancel()
        self._waiting.clear()
        self._socket.close(linger=0)
        self._context.term()

    async def __aenter__(self) -> AsyncConnection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncModel:
    def __init__(
        self, connection: AsyncConnection, model_id: str, *, latency_budget_ms: float, priority: int
    ) -> None:
        self._conn = connection
        self.model_id = model_id
        self.latency_budget_ms = latency_budget_ms
        self.priority = priority
        self._pending: collections.deque[tuple[str, asyncio.Future[_Reply]]] = collections.deque()

    def observe(
        self,
        *,
        urgency: float = 0.0,
        steps_remaining: int | None = None,
        priority: int | None = None,
        timeout_ms: float | None = None,
        **tensors: np.ndarray,
    ) -> str:
        """Send one observation (no wait); returns its request id. Collect it with `get_result`."""
        request_id, future = self._send(urgency, steps_remaining, priority, timeout_ms, tensors)
        self._pending.append((request_id, future))
        return request_id

    async def get_result(self, timeout_ms: float = 100) -> dict[str, Any] | None:
        """The reply to the oldest outstanding observation, or None if it has not come in time."""
        if not self._pending:
            return None
        _, future = self._pending[0]
        try:
            response, payload = await asyncio.wait_for(asyncio.shield(future), timeout_ms / 1000)
        except TimeoutError:
            return None
        self._pending.popleft()
        return read_reply(response, payload)

    async def infer(self, *, timeout_ms: float = 5000, **tensors: np.ndarray) -> dict[str, np.ndarray]:
        """Send one observation and await its outputs; raise a typed error on failure.

        Independent of `observe`/`get_result`: many `infer` calls may run concurrently.
        """
        request_id, future = self._send(0.0, None, None, timeout_ms, tensors)
        try:
            response, payload = await asyncio.wait_for(future, (timeout_ms + 1000) / 1000)
        except TimeoutError:
            raise NoReplyError(f"no reply from {self.model_id} within {timeout_ms:.0f} ms") from None
        finally:
            self._conn._forget(request_id)
        return tensors_of(read_reply(response, payload))

    def _send(
        self,
        urgency: float,
        steps_remaining: int | None,
        priority: int | None,
        timeout_ms: float | None,
        tensors: dict[str, np.ndarray],
    ) -> tuple[str, asyncio.Future[_Reply]]:
        request_id, observation, payload = self._conn._observation(
            self.model_id,
            urgency=urgency,
            priority=self.priority if priority is None else priority,
            steps_remaining=steps_remaining,
            timeout_ms=timeout_ms,
            tensors=tensors,
        )
        return request_id, self._conn._send(observation, payload, request_id)
