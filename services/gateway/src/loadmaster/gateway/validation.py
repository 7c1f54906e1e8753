"""Edge envelope validation: bytes from a client -> an `InferenceCall`, or `InvalidArgumentError`."""

from __future__ import annotations

import math
import time
from typing import Any

from google.protobuf.message import DecodeError

from loadmaster.common.config import LimitsSettings
from loadmaster.common.errors import InvalidArgumentError
from loadmaster.common.tensors import TensorLimits, check_tensors
from loadmaster.gateway.calls import InferenceCall
from loadmaster.v1 import edge_pb2

__all__ = ["TIMEOUT_KEY", "observation_to_call", "parse_observation"]

TIMEOUT_KEY = "timeout_ms"


def parse_observation(envelope: bytes, limits: LimitsSettings) -> edge_pb2.Observation:
    if len(envelope) > limits.max_envelope_bytes:
        raise InvalidArgumentError(
            f"envelope of {len(envelope)} bytes exceeds the limit of {limits.max_envelope_bytes}"
        )
    try:
        observation = edge_pb2.Observation.FromString(envelope)
    except DecodeError as error:
        raise InvalidArgumentError(f"envelope is not an Observation: {error}") from None
    if not observation.model_id:
        raise InvalidArgumentError("model_id is empty")
    return observation


def observation_to_call(
    observation: edge_pb2.Observation,
    payload: Any,
    *,
    request_id: str,
    limits: LimitsSettings,
) -> InferenceCall:
    """Check the observation against its payload and limits, without copying the payload or
    building arrays over it (the gateway only forwards it)."""
    buffer = payload.buffer if hasattr(payload, "buffer") else payload
    check_tensors(
        observation.tensors,
        buffer,
        TensorLimits(
            max_payload_bytes=limits.max_payload_bytes,
            max_tensors=limits.max_tensors,
            max_dims=limits.max_dims,
        ),
    )
    metadata = dict(observation.metadata) if observation.metadata else {}
    metadata_bytes = sum(len(k) + len(v) for k, v in metadata.items())
    if metadata_bytes > limits.max_metadata_bytes:
        raise InvalidArgumentError(
            f"metadata of {metadata_bytes} bytes exceeds the limit of {limits.max_metadata_bytes}"
        )
    timeout_ms = 0.0
    if TIMEOUT_KEY in metadata:
        try:
            timeout_ms = float(metadata[TIMEOUT_KEY])
        except ValueError:
            raise InvalidArgumentError(f"metadata '{TIMEOUT_KEY}' is not a number") from None
        if not math.isfinite(timeout_ms) or timeout_ms <= 0:
            raise InvalidArgumentError(f"metadata '{TIMEOUT_KEY}' must be a positive number of milliseconds")
    urgency = observation.urgency
    if not math.isfinite(urgency):
        raise InvalidArgumentError("urgency must be a finite number")
    return InferenceCall(
        request_id=request_id,
        client_id=observation.client.id,
        client_type=observation.client.type,
        model_id=observation.model_id,
        inputs=observation.tensors,
        payload=payload,
        priority=observation.priority,
        urgency=min(max(urgency, 0.0), 1.0),
        steps_remaining=observation.steps_remaining if observation.HasField("steps_remaining") else None,
        timeout_ms=timeout_ms,
        metadata=metadata,
        received_unix_ns=time.time_ns(),
        received_monotonic=time.monotonic(),
    )
