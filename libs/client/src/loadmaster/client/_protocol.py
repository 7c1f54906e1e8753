"""What the sync and async edge clients share: building observations, reading replies, sockets."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from loadmaster.common.errors import LoadmasterError, error_for_code
from loadmaster.common.framing import ERROR_CODE_KEY, ERROR_KEY, REQUEST_ID_KEY
from loadmaster.common.tensors import decode_tensors, encode_tensors
from loadmaster.v1 import edge_pb2, errors_pb2

__all__ = [
    "CurveKeys",
    "EdgeClient",
    "NoReplyError",
    "build_observation",
    "configure_socket",
    "raise_for_error",
    "read_reply",
]

_CODES = {name.removeprefix("ERROR_CODE_").lower(): number for name, number in errors_pb2.ErrorCode.items()}


class NoReplyError(LoadmasterError):
    """No reply came within the caller's timeout (the request may still be answered later; it is dropped)."""


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """CurveZMQ keys (Z85 text): the gateway's public key and this client's key pair.

    `loadmaster keys curve` makes pairs. Without a client pair a fresh one is made per
    connection (enough when the gateway allows any client that knows its public key).
    """

    server_public_key: str
    client_public_key: str = ""
    client_secret_key: str = ""


def raise_for_error(metadata: Mapping[str, str]) -> None:
    """Raise the typed error a reply's metadata describes, if any."""
    code = metadata.get(ERROR_CODE_KEY)
    if code:
        raise error_for_code(_CODES.get(code, errors_pb2.ERROR_CODE_INTERNAL), metadata.get(ERROR_KEY, code))


def configure_socket(socket: zmq.Socket, *, client_id: str, curve: CurveKeys | None) -> None:  # type: ignore[type-arg]
    socket.setsockopt(zmq.IDENTITY, client_id.encode())
    socket.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        if curve.client_secret_key:
            public, secret = curve.client_public_key.encode(), curve.client_secret_key.encode()
            if not public:
                public = zmq.curve_public(secret)
        else:
            public, secret = zmq.curve_keypair()
        socket.curve_secretkey = secret
        socket.curve_publickey = public
        socket.curve_serverkey = curve.server_public_key.encode()


def endpoint(server: str) -> str:
    return server if "://" in server else f"tcp://{server}"


class EdgeClient:
    """What the sync and async connections share: the client's identity, its DEALER socket
    (identity = client id, optional CURVE) connected to the gateway, and request ids."""

    def __init__(
        self,
        context: zmq.Context,  # type: ignore[type-arg]
        server: str,
        client_id: str | None,
        client_type: str,
        curve: CurveKeys | None,
    ) -> None:
        self.client_id = client_id or f"lm-{uuid.uuid4().hex[:12]}"
        self.client_type = client_type
        self._context = context
        self._socket = context.socket(zmq.DEALER)
        configure_socket(self._socket, client_id=self.client_id, curve=curve)
        self._socket.connect(endpoint(server))
        self._ids = itertools.count(1)

    def _next_id(self) -> str:
        return f"{self.client_id}-{next(self._ids)}"

    def _observation(
        self,
        model_id: str,
        *,
        urgency: float,
        priority: int,
        steps_remaining: int | None,
        timeout_ms: float | None,
        tensors: Mapping[str, np.ndarray],
    ) -> tuple[str, edge_pb2.Observation, Any]:
        """A new request id and the observation (and payload) that carries it."""
        request_id = self._next_id()
        observation, payload = build_observation(
            client_id=self.client_id,
            client_type=self.client_type,
            model_id=model_id,
            request_id=request_id,
            urgency=urgency,
            priority=priority,
            steps_remaining=steps_remaining,
            timeout_ms=timeout_ms,
            tensors=tensors,
        )
        return request_id, observation, payload


def build_observation(
    *,
    client_id: str,
    client_type: str,
    model_id: str,
    request_id: str,
    urgency: float,
    priority: int,
    steps_remaining: int | None,
    timeout_ms: float | None,
    tensors: Mapping[str, np.ndarray],
) -> tuple[edge_pb2.Observation, Any]:
    descriptors, payload = encode_tensors(tensors, timestamp_ns=time.time_ns())
    observation = edge_pb2.Observation(
        client=edge_pb2.Client(id=client_id, type=client_type),
        timestamp_ns=time.time_ns(),
        urgency=urgency,
        tensors=descriptors,
        model_id=model_id,
        priority=priority,
    )
    if steps_remaining is not None:
        observation.steps_remaining = steps_remaining
    if timeout_ms is not None:
        observation.metadata["timeout_ms"] = str(timeout_ms)
    observation.metadata[REQUEST_ID_KEY] = request_id
    return observation, payload


def reply_id(response: edge_pb2.ModelResponse) -> str:
    return response.metadata.get(REQUEST_ID_KEY, response.response_id)


def read_reply(response: edge_pb2.ModelResponse, payload: bytes) -> dict[str, Any]:
    """A reply as Inferential returns it (arrays + metadata); raises the typed error of a failure."""
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


def tensors_of(result: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {key: value for key, value in result.items() if isinstance(value, np.ndarray)}
