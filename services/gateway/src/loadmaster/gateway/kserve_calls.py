"""A KServe v2 call as the gateway's core sees it: tensors <-> one call, and awaiting it.

Used by the KServe v2 front ends (gRPC and HTTP) and by the routes that turn their own
bodies into tensor calls (images, embeddings, KServe's `text_input` on language models).

Both front ends reduce a v2 request to `KServeInput`s (name, datatype, shape,
raw little-endian bytes) plus the `priority` / `timeout` parameters, and this
module turns those into one `InferenceCall` for the dispatcher: descriptors
with offsets into one payload, checked against the gateway's limits. Outputs
come back as `KServeOutput`s. Queueing, retries and error mapping stay in the
dispatcher; a caller that goes away cancels its call there.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.common.gateway_config import LimitsSettings
from loadmaster.common.tensors import check_tensors, shape_elements_at_most
from loadmaster.gateway.calls import CallResult, InferenceCall
from loadmaster.gateway.dispatcher import Dispatcher
from loadmaster.gateway.validation import INLINE_BYTES_ELEMENTS, tensor_limits
from loadmaster.v1 import model_pool_pb2, tensor_pb2

__all__ = [
    "DATATYPES",
    "DEFAULT_PRIORITY",
    "EXTENSIONS",
    "SERVER_NAME",
    "SERVER_VERSION",
    "KServeInput",
    "KServeOutput",
    "TensorMetadata",
    "build_call",
    "check_parameters",
    "costly",
    "dispatch",
    "numpy_for",
    "outputs_of",
    "parse_priority",
    "parse_timeout_ms",
    "tensor_metadata",
]

DEFAULT_PRIORITY = 1  # Loadmaster priorities: 0 = highest
SERVER_NAME = "loadmaster"
SERVER_VERSION = "0.1.0"
EXTENSIONS = ["model_repository", "statistics", "binary_tensor_data", "parameters"]

# KServe v2 datatype <-> wire dtype. BF16 travels as raw 2-byte words; BYTES in the v2
# layout (4-byte little-endian length before each element), which is also ours.
DATATYPES: dict[str, int] = {
    "BYTES": tensor_pb2.DTYPE_BYTES,
    "BOOL": tensor_pb2.DTYPE_BOOL,
    "UINT8": tensor_pb2.DTYPE_UINT8,
    "INT32": tensor_pb2.DTYPE_INT32,
    "INT64": tensor_pb2.DTYPE_INT64,
    "FP16": tensor_pb2.DTYPE_FLOAT16,
    "FP32": tensor_pb2.DTYPE_FLOAT32,
    "FP64": tensor_pb2.DTYPE_FLOAT64,
    "BF16": tensor_pb2.DTYPE_BFLOAT16,
}
_NAMES: dict[int, str] = {wire: name for name, wire in DATATYPES.items()}
_NUMPY: dict[str, np.dtype] = {
    "BYTES": np.dtype(object),
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BF16": np.dtype(np.uint16),
}


@dataclass(frozen=True, slots=True)
class KServeInput:
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes | memoryview  # raw little-endian bytes


@dataclass(frozen=True, slots=True)
class KServeOutput:
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: memoryview


@dataclass(frozen=True, slots=True)
class TensorMetadata:
    """One declared input or output, as v2 model metadata lists it."""

    name: str
    datatype: str
    shape: tuple[int, ...]  # -1 = any size on that axis


def tensor_metadata(specs: Iterable[model_pool_pb2.TensorSpec]) -> list[TensorMetadata]:
    """v2 metadata entries for a model's declared tensors (an undeclared shape is `[-1]`)."""
    return [
        TensorMetadata(
            spec.name, _NAMES.get(spec.dtype, "BYTES"), (-1,) if spec.any_shape else tuple(spec.shape)
        )
        for spec in specs
    ]


def numpy_for(name: str, datatype: str) -> np.dtype:
    """The numpy dtype of a v2 datatype; `InvalidArgumentError` naming the tensor otherwise."""
    try:
        return _NUMPY[datatype]
    except KeyError:
        supported = ", ".join(_NUMPY)
        raise InvalidArgumentError(
            f"tensor '{name}': datatype {datatype!r} is not supported (supported: {supported})"
        ) from None


def parse_priority(value: Any) -> int:
    """The v2 `priority` parameter -> Loadmaster's priority (0 = highest, default 1).

    As in Triton's: 0 or absent = the default, 1 = the highest, larger = lower. So v2
    priority p >= 1 is Loadmaster priority p - 1 (v2 1 -> 0, v2 2 -> 1 = the default).
    """
    if value is None:
        return DEFAULT_PRIORITY
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**32:
        raise InvalidArgumentError(f"parameter 'priority' must be an integer in [0, 2^32], got {value!r}")
    return DEFAULT_PRIORITY if value == 0 else value - 1


def parse_timeout_ms(value: Any, *, deadline_s: float | None = None) -> float:
    """The v2 `timeout` parameter (microseconds) and/or a transport deadline -> timeout in ms (0 = none)."""
    timeout_ms = 0.0
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise InvalidArgumentError(f"parameter 'timeout' must be a number of microseconds, got {value!r}")
        if value < 0:
            raise InvalidArgumentError("parameter 'timeout' must not be negative")
        timeout_ms = value / 1000.0
    if deadline_s is not None:
        deadline_ms = max(deadline_s * 1000.0, 0.001)
        timeout_ms = deadline_ms if timeout_ms == 0 else min(timeout_ms, deadline_ms)
    return timeout_ms


def check_parameters(parameters: Mapping[str, Any], limits: LimitsSettings) -> None:
    """Request parameters are the v2 analog of edge metadata: the same size limit applies."""
    size = sum(len(str(key)) + len(str(value)) for key, value in parameters.items())
    if size > limits.max_metadata_bytes:
        raise InvalidArgumentError(
            f"request parameters of {size} bytes exceed the limit of {limits.max_metadata_bytes}"
        )


_INT64 = 1 << 63
INLINE_RAW_BYTES = 1 << 20  # tensor data up to this size is gathered and checked on the loop


def costly(inputs: Sequence[tuple[str, Sequence[int], int]]) -> bool:
    """Whether building a call from inputs of (datatype, shape, raw bytes) costs enough to
    leave the event loop: BYTES elements to walk, values to convert, or data to copy."""
    elements = raw = 0
    for datatype, shape, raw_bytes in inputs:
        if raw_bytes == 0 or datatype == "BYTES":  # typed contents to convert, or elements to walk
            elements += shape_elements_at_most(shape, INLINE_BYTES_ELEMENTS)
        raw += raw_bytes
        if elements > INLINE_BYTES_ELEMENTS or raw > INLINE_RAW_BYTES:
            return True
    return False


def build_call(
    inputs: Sequence[KServeInput],
    *,
    model_id: str,
    request_id: str,
    client_id: str,
    priority: int,
    timeout_ms: float,
    limits: LimitsSettings,
    metadata: Mapping[str, str] | None = None,
) -> InferenceCall:
    """One `InferenceCall` from v2 inputs: descriptors into one payload, checked against `limits`."""
    if not model_id:
        raise InvalidArgumentError("model name is empty")
    if len(inputs) > limits.max_tensors:
        raise InvalidArgumentError(f"{len(inputs)} tensors exceed the limit of {limits.max_tensors}")
    descriptors: list[tensor_pb2.Tensor] = []
    parts: list[bytes | memoryview] = []
    offset = 0
    for tensor in inputs:
        if tensor.datatype not in DATATYPES:
            numpy_for(tensor.name, tensor.datatype)  # raises, naming the tensor
        if len(tensor.shape) > limits.max_dims:
            raise InvalidArgumentError(
                f"tensor '{tensor.name}': {len(tensor.shape)} dimensions exceed the limit of {limits.max_dims}"
            )
        for dim in tensor.shape:
            if not -_INT64 <= dim < _INT64:
                raise InvalidArgumentError(
                    f"tensor '{tensor.name}': dimension {dim} of shape {list(tensor.shape)} does not fit in int64"
                )
        length = len(tensor.data)
        descriptors.append(
            tensor_pb2.Tensor(
                key=tensor.name,
                dtype=DATATYPES[tensor.datatype],  # type: ignore[arg-type]
                shape=tensor.shape,
                byte_offset=offset,
                byte_length=length,
                encoding=tensor_pb2.ENCODING_RAW,
            )
        )
        parts.append(tensor.data)
        offset += length
        if offset > limits.max_payload_bytes:
            raise InvalidArgumentError(
                f"tensor data of {offset}+ bytes exceeds the limit of {limits.max_payload_bytes}"
            )
    payload: bytes | memoryview = parts[0] if len(parts) == 1 else b"".join(parts)
    # dtype x shape against lengths, duplicates, empty names, BYTES layout: errors name the tensor
    check_tensors(descriptors, payload, tensor_limits(limits))
    meta = dict(metadata or {})
    metadata_bytes = sum(len(k) + len(v) for k, v in meta.items())
    if metadata_bytes > limits.max_metadata_bytes:
        raise InvalidArgumentError(
            f"metadata of {metadata_bytes} bytes exceeds the limit of {limits.max_metadata_bytes}"
        )
    return InferenceCall(
        request_id=request_id,
        client_id=client_id,
        client_type="kserve",
        connection_bound=True,  # the HTTP and gRPC front ends cancel it when the client goes
        model_id=model_id,
        inputs=descriptors,
        payload=payload,
        priority=priority,
        timeout_ms=timeout_ms,
        metadata=meta,
        received_unix_ns=time.time_ns(),
        received_monotonic=time.monotonic(),
    )


def outputs_of(result: CallResult, requested: Iterable[str] = ()) -> list[KServeOutput]:
    """The v2 outputs of a successful call, only the `requested` ones when any are named."""
    wanted = set(requested)
    payload = result.payload
    buffer = memoryview(payload.buffer if hasattr(payload, "buffer") else payload).cast("B")
    outputs: list[KServeOutput] = []
    for desc in result.outputs:
        if wanted and desc.key not in wanted:
            continue
        datatype = _NAMES.get(desc.dtype)
        if datatype is None:
            raise InvalidArgumentError(f"output '{desc.key}' has dtype {desc.dtype}, which v2 cannot carry")
        start = desc.byte_offset
        outputs.append(
            KServeOutput(desc.key, datatype, tuple(desc.shape), buffer[start : start + desc.byte_length])
        )
    missing = wanted - {output.name for output in outputs}
    if missing:
        raise InvalidArgumentError(f"requested output(s) {sorted(missing)} not produced by {result.model_id}")
    return outputs


async def dispatch(dispatcher: Dispatcher, call: InferenceCall) -> CallResult:
    """Submit `call` and await its one result; if the caller goes away, cancel it in the dispatcher."""
    future: asyncio.Future[CallResult] = asyncio.get_running_loop().create_future()

    def on_result(result: CallResult) -> None:
        if not future.done():
            future.set_result(result)

    dispatcher.submit(call, on_result)
    try:
        result = await future
    except asyncio.CancelledError:
        dispatcher.cancel(call.request_id)
        raise
    if result.error is not None:
        raise result.error
    return result
