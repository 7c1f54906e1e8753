"""Synchronous client for the ZMQ edge protocol, with the Inferential client's API shape.

    conn = Connection("tcp://127.0.0.1:5555")
    policy = conn.model("policy", priority=0)
    action = policy.infer(state=np.zeros((1, 32), np.float32))["action"]

Every observation carries a request id in its metadata; the gateway echoes it,
so a reply that arrives after its `get_result` timed out is discarded instead of
being returned for a later request. Failures raise the typed errors of
`loadmaster.common.errors` (e.g. `NotFoundError`, `ExpiredError`). Pass
`curve=CurveKeys(...)` when the gateway's edge requires CurveZMQ.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import numpy as np
import zmq

from loadmaster.client._protocol import (
    CurveKeys,
    EdgeClient,
    NoReplyError,
    raise_for_error,
    read_reply,
    reply_id,
    tensors_of,
)
from loadmaster.v1 import edge_pb2

__all__ = ["Connection", "CurveKeys", "Model", "NoReplyError", "raise_for_error"]


class Connection(EdgeClient):
    def __init__(
        self,
        server: str = "tcp://127.0.0.1:5555",
        client_id: str | None = None,
        client_type: str = "",
        *,
        curve: CurveKeys | None = None,
    ) -> None:
        super().__init__(zmq.Context(), server, client_id, client_type, curve)
        # replies that arrived for a request other than the one being waited for
        self._inbox: dict[str, tuple[edge_pb2.ModelResponse, bytes]] = {}
        self._outstanding: dict[str, collections.deque[str]] = collections.defaultdict(collections.deque)

    def model(self, model_id: str, *, latency_budget_ms: float = 50.0, priority: int = 1) -> Model:
        return Model(self, model_id, latency_budget_ms=latency_budget_ms, priority=priority)

    def _send(self, observation: edge_pb2.Observation, payload: Any, request_id: str) -> None:
        self._socket.send_multipart([b"", observation.SerializeToString(), payload], copy=False)
        self._outstanding[observation.model_id].append(request_id)

    def _receive(self, request_id: str, timeout_ms: float) -> tuple[edge_pb2.ModelResponse, bytes] | None:
        deadline = time.monotonic() + timeout_ms / 1000
        while request_id not in self._inbox:
            remaining_ms = (deadline - time.monotonic()) * 1000
            if remaining_ms <= 0 or not self._socket.poll(max(1, int(remaining_ms)), zmq.POLLIN):
                return None
            frames = self._socket.recv_multipart()
            if len(frames) < 2:
                continue
            response = edge_pb2.ModelResponse.FromString(frames[1])
            rid = reply_id(response)
            if rid in self._outstanding[response.model_id]:
                self._inbox[rid] = (response, frames[2] if len(frames) > 2 else b"")
        return self._inbox.pop(request_id)

    def _forget(self, model_id: str, request_id: str) -> None:
        outstanding = self._outstanding[model_id]
        if request_id in outstanding:
            outstanding.remove(request_id)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Model:
    def __init__(
        self, connection: Connection, model_id: str, *, latency_budget_ms: float, priority: int
    ) -> None:
        self._conn = connection
        self.model_id = model_id
        self.latency_budget_ms = latency_budget_ms
        self.priority = priority
        self._pending: collections.deque[str] = collections.deque()

    def observe(
        self,
        *,
        urgency: float = 0.0,
        steps_remaining: int | None = None,
        priority: int | None = None,
        timeout_ms: float | None = None,
        **tensors: np.ndarray,
    ) -> str:
        """Send one observation; returns its request id. Collect the reply with `get_result`."""
        return self._observe(urgency, steps_remaining, priority, timeout_ms, tensors)

    def _observe(
        self,
        urgency: float,
        steps_remaining: int | None,
        priority: int | None,
        timeout_ms: float | None,
        tensors: dict[str, np.ndarray],
    ) -> str:
        request_id, observation, payload = self._conn._observation(
            self.model_id,
            urgency=urgency,
            priority=self.priority if priority is None else priority,
            steps_remaining=steps_remaining,
            timeout_ms=timeout_ms,
            tensors=tensors,
        )
        self._conn._send(observation, payload, request_id)
        self._pending.append(request_id)
        return request_id

    def get_result(self, timeout_ms: float = 100) -> dict[str, Any] | None:
        """The reply to the oldest outstanding observation, or None if it has not come in time.

        A request that timed out stays outstanding: the next call waits for it again,
        and its late reply is never mistaken for a newer request's.
        """
        if not self._pending:
            return None
        request_id = self._pending[0]
        received = self._conn._receive(request_id, timeout_ms)
        if received is None:
            return None
        self._pending.popleft()
        self._conn._forget(self.model_id, request_id)
        return read_reply(*received)

    def infer(self, *, timeout_ms: float = 5000, **tensors: np.ndarray) -> dict[str, np.ndarray]:
        """Send one observation and wait for its outputs; raise a typed error on failure."""
        if self._pending:
            raise RuntimeError("infer() called with observations outstanding; collect them with get_result()")
        self._observe(0.0, None, None, timeout_ms, tensors)
        result = self.get_result(timeout_ms=timeout_ms + 1000)
        if result is None:
            request_id = self._pending.popleft()
            self._conn._forget(self.model_id, request_id)
            raise NoReplyError(f"no reply from {self.model_id} within {timeout_ms:.0f} ms")
        return tensors_of(result)
