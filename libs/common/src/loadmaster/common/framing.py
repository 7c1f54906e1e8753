"""Envelope + payload framing shared by the ZMQ edge and the worker data plane.

Both use the same multipart layout on a ROUTER socket:
    incoming  [identity, b"", envelope, payload]
    outgoing  [identity, b"", envelope, payload]
The payload frame is optional on input (an observation without tensors).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loadmaster.common.errors import InvalidArgumentError, LoadmasterError
from loadmaster.v1 import edge_pb2, tensor_pb2

__all__ = [
    "ERROR_CODE_KEY",
    "ERROR_KEY",
    "REQUEST_ID_KEY",
    "RouterFrames",
    "edge_error_response",
    "router_reply",
    "split_router_frames",
]

ERROR_KEY = "error"
ERROR_CODE_KEY = "error_code"
REQUEST_ID_KEY = "request_id"


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


# Re-exported for callers building descriptors by hand.
Tensor = tensor_pb2.Tensor
