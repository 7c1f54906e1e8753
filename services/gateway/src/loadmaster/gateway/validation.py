"""Edge envelope validation: bytes from a client -> an `InferenceCall`, or `InvalidArgumentError`.

Checks whose cost grows with the input (BYTES tensors walk their elements) run off the event
loop, on a small thread pool of their own (`off_loop`): `needs_off_loop` says which
observations, `observation_to_call_off_loop` is the awaitable form of `observation_to_call`.
Everything else stays inline, where a thread hop would cost more than the check.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import math
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.common.gateway_config import LimitsSettings
from loadmaster.common.tensors import TensorLimits, check_tensors, shape_elements_at_most
from loadmaster.gateway.calls import InferenceCall
from loadmaster.v1 import edge_pb2, tensor_pb2

__all__ = [
    "INLINE_BYTES_ELEMENTS",
    "TIMEOUT_KEY",
    "bytes_elements",
    "needs_off_loop",
    "observation_to_call",
    "observation_to_call_off_loop",
    "off_loop",
    "parse_observation",
    "tensor_limits",
]

TIMEOUT_KEY = "timeout_ms"
# BYTES elements a request may carry and still be checked on the event loop (~25 us of work).
INLINE_BYTES_ELEMENTS = 1024

_T = TypeVar("_T")
# Two threads: numpy releases the interpreter in its loops, so they overlap the event loop,
# and a flood of large requests queues here instead of taking the loop's default executor.
_VALIDATION_THREADS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gateway-validation")


async def off_loop(function: Callable[..., _T], /, *args: Any, **kwargs: Any) -> _T:
    """`function(*args, **kwargs)` on the validation threads, awaited from the event loop."""
    call = functools.partial(contextvars.copy_context().run, function, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_VALIDATION_THREADS, call)


def tensor_limits(limits: LimitsSettings) -> TensorLimits:
    return TensorLimits(
        max_payload_bytes=limits.max_payload_bytes,
        max_tensors=limits.max_tensors,
        max_dims=limits.max_dims,
        max_bytes_elements=limits.max_bytes_elements,
        max_image_pixels=limits.max_image_pixels,
    )


def bytes_elements(descriptors: Iterable[tensor_pb2.Tensor], cap: int = INLINE_BYTES_ELEMENTS) -> int:
    """How many BYTES elements the descriptors claim (what checking them costs), counted only
    up to `cap` (more answers `cap + 1`), so the count itself costs little whatever the shapes."""
    total = 0
    for desc in descriptors:
        if desc.dtype == tensor_pb2.DTYPE_BYTES:
            total += shape_elements_at_most(desc.shape, cap)
            if total > cap:
                return cap + 1
    return total


def needs_off_loop(observation: edge_pb2.Observation) -> bool:
    """Whether checking `observation` costs enough to leave the event loop for it."""
    return bytes_elements(observation.tensors) > INLINE_BYTES_ELEMENTS


async def observation_to_call_off_loop(
    observation: edge_pb2.Observation,
    payload: Any,
    *,
    request_id: str,
    limits: LimitsSettings,
) -> InferenceCall:
    """`observation_to_call`, on the validation threads when `needs_off_loop(observation)`."""
    if not needs_off_loop(observation):
        return observation_to_call(observation, payload, request_id=request_id, limits=limits)
    return await off_loop(observation_to_call, observation, payload, request_id=request_id, limits=limits)


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
    check_tensors(observation.tensors, buffer, tensor_limits(limits))
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
