"""Synchronous client for the ZMQ edge protocol, with the Inferential client's API shape.

    conn = Connection("tcp://127.0.0.1:5555")
    policy = conn.model("policy", priority=0)
    action = policy.infer(state=np.zeros((1, 32), np.float32))["action"]

Every observation carries a request id in its metadata; the gateway echoes it,
so a reply that arrives after its `get_result` timed out is discarded instead of
being returned for a later request. Failures raise the typed errors of
`loadmaster.common.errors` (e.g. `NotFoundError`, `ExpiredError`).
"""

from __future__ import annotations

import collections
import itertools
import time
import uuid
from typing import Any

import numpy as np
import zmq

from loadmaster.common.errors import LoadmasterError, error_for_code
from loadmaster.common.framing import ERROR_CODE_KEY, ERROR_KEY, REQUEST_ID_KEY
from loadmaster.common.tensors import decode_tensors, encode_tensors
from loadmaster.v1 import edge_pb2, errors_pb2

__all__ = ["Connection", "Model", "raise_for_error"]

_CODES = {name.removeprefix("ERROR_CODE_").lower(): number for name, number in errors_pb2.ErrorCode.items()}


def raise_for_error(metadata: dict[str, str]) -> None:
    """Raise the typed error a reply's metadata describes, if any."""
    code = metadata.get(ERROR_CODE_KEY)
    if code:
        raise error_for_code(_CODES.get(code, errors_pb2.ERROR_CODE_INTERNAL), metadata.get(ERROR_KEY, code))


class Connection:
    def __init__(
        self,
        server: str = "tcp://127.0.0.1:5555",
        client_id: str | None = None,
        client_type: str = "",
    ) -> None:
        self.client_id = client_id or f"lm-{uuid.uuid4().hex[:12]}"
        self.client_type = client_type
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, self.client_id.encode())
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(server if "://" in server else f"tcp://{server}")
        self._ids = itertools.count(1)
        # replies that arrived for a request other than the one being waited for
        self._inbox: dict[str, tuple[edge_pb2.ModelResponse, bytes]] = {}
        self._outstanding: dict[str, collections.deque[str]] = collections.defaultdict(collections.deque)

    def model(self, model_id: str, *, latency_budget_ms: float = 50.0, priority: int = 1) -> Model:
        return Model(self, model_id, latency_budget_ms=latency_budget_ms, priority=priority)

    def _send(self, observation: edge_pb2.Observation, payload: Any) -> str:
        request_id = f"{self.client_id}-{next(self._ids)}"
        observation.metadata[REQUEST_ID_KEY] = request_id
        self._socket.send_multipart([b"", observation.SerializeToString(), payload], copy=False)
        self._outstanding[observation.model_id].append(request_id)
        return request_id

    def _receive(self, request_id: str, timeout_ms: float) -> tuple[edge_pb2.ModelResponse, bytes] | None:
        deadline = time.monotonic() + timeout_ms / 1000
        while request_id not in self._inbox:
            remaining_ms = (deadline - time.monotonic()) * 1000
            if remaining_ms <= 0 or not self._socket.poll(max(1, int(remaining_ms)), zmq.POLLIN):
                return None
            frames = self._socket.recv_multipart()
            response = edge_pb2.ModelResponse.FromString(frames[1])
            rid = response.metadata.get(REQUEST_ID_KEY, response.response_id)
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
        urgency: float = 0.0,
        steps_remaining: int | None = None,
        priority: int | None = None,
        timeout_ms: float | None = None,
        **tensors: np.ndarray,
    ) -> str:
        """Send one observation; returns its request id. Collect the reply with `get_result`."""
        descriptors, payload = encode_tensors(tensors, timestamp_ns=time.time_ns())
        observation = edge_pb2.Observation(
            client=edge_pb2.Client(id=self._conn.client_id, type=self._conn.client_type),
            timestamp_ns=time.time_ns(),
            urgency=urgency,
            tensors=descriptors,
            model_id=self.model_id,
            priority=self.priority if priority is None else priority,
        )
        if steps_remaining is not None:
            observation.steps_remaining = steps_remaining
        if timeout_ms is not None:
            observation.metadata["timeout_ms"] = str(timeout_ms)
        request_id = self._conn._send(observation, payload)
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
        response, payload = received
        metadata = dict(response.metadata)
        raise_for_error(metadata)
        result: dict[str, Any] = {
            key: np.array(value) for key, value in decode_tensors(response.tensors, payload).items()
        }
        result.update(metadata)
        result["response_id"] = response.response_id
        result["model_id"] = response.model_id
        result["inference_latency_ms"] = response.inference_latency_ms
        return result

    def infer(self, *, timeout_ms: float = 5000, **tensors: np.ndarray) -> dict[str, np.ndarray]:
        """Send one observation and wait for its outputs; raise a typed error on failure."""
        if self._pending:
            raise RuntimeError("infer() called with observations outstanding; collect them with get_result()")
        self.observe(timeout_ms=timeout_ms, **tensors)
        result = self.get_result(timeout_ms=timeout_ms + 1000)
        if result is None:
            request_id = self._pending.popleft()
            self._conn._forget(self.model_id, request_id)
            raise LoadmasterError(f"no reply from {self.model_id} within {timeout_ms:.0f} ms")
        return {key: value for key, value in result.items() if isinstance(value, np.ndarray)}
