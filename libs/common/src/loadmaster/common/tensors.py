"""Tensor codec: descriptors + one binary payload <-> `dict[str, np.ndarray]`.

Decoding returns read-only zero-copy views into the payload after checking every
descriptor against it (offsets, lengths, dtype x shape, overlaps, limits), so a
bad envelope is answered `invalid_argument` naming the tensor, never a crash.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.v1 import tensor_pb2

__all__ = [
    "TensorLimits",
    "check_tensors",
    "decode_tensors",
    "deserialize_bytes",
    "encode_tensors",
    "numpy_dtype",
    "serialize_bytes",
    "wire_dtype",
]

# BFLOAT16 has no numpy dtype: its raw 2-byte words travel as uint16.
_TO_NUMPY: dict[int, np.dtype] = {
    tensor_pb2.FLOAT16: np.dtype(np.float16),
    tensor_pb2.FLOAT32: np.dtype(np.float32),
    tensor_pb2.FLOAT64: np.dtype(np.float64),
    tensor_pb2.BFLOAT16: np.dtype(np.uint16),
    tensor_pb2.UINT8: np.dtype(np.uint8),
    tensor_pb2.INT32: np.dtype(np.int32),
    tensor_pb2.INT64: np.dtype(np.int64),
    tensor_pb2.BOOL: np.dtype(np.bool_),
}
_FROM_NUMPY: dict[np.dtype, int] = {
    dtype: wire for wire, dtype in _TO_NUMPY.items() if wire != tensor_pb2.BFLOAT16
}
_ACCEPTED_ENCODINGS = (tensor_pb2.ENCODING_UNSPECIFIED, tensor_pb2.RAW)
_LENGTH = struct.Struct("<I")  # BYTES element prefix


@dataclass(frozen=True, slots=True)
class TensorLimits:
    max_payload_bytes: int = 64 << 20
    max_tensors: int = 64
    max_dims: int = 8


def numpy_dtype(wire: int) -> np.dtype:
    if wire == tensor_pb2.BYTES:
        return np.dtype(object)
    try:
        return _TO_NUMPY[wire]
    except KeyError:
        raise InvalidArgumentError(f"unsupported dtype {wire}") from None


def wire_dtype(dtype: np.dtype) -> int:
    wire = _FROM_NUMPY.get(dtype)  # the common case, a numpy dtype, without converting it twice
    if wire is not None:
        return wire
    if np.dtype(dtype).kind in "OSU":
        return tensor_pb2.BYTES
    try:
        return _FROM_NUMPY[np.dtype(dtype)]
    except KeyError:
        supported = ", ".join(sorted(d.name for d in _FROM_NUMPY))
        raise InvalidArgumentError(
            f"dtype {np.dtype(dtype).name} cannot travel on the wire (supported: {supported})"
        ) from None


def _dtype_name(wire: int) -> str:
    try:
        return tensor_pb2.DType.Name(wire)
    except ValueError:
        return str(wire)


def decode_tensors(
    descriptors: Sequence[tensor_pb2.Tensor],
    payload: bytes | memoryview,
    limits: TensorLimits = TensorLimits(),
) -> dict[str, np.ndarray]:
    """Validate `descriptors` against `payload` and return read-only views, keyed by tensor key."""
    arrays: dict[str, np.ndarray] = {}
    _check(descriptors, payload, limits, arrays)
    return arrays


def check_tensors(
    descriptors: Sequence[tensor_pb2.Tensor],
    payload: bytes | memoryview,
    limits: TensorLimits = TensorLimits(),
) -> None:
    """Every check of `decode_tensors`, with the same errors, without building the arrays: for
    a hop that only forwards the payload (the gateway), views it would never read are waste."""
    _check(descriptors, payload, limits, None)


def _check(
    descriptors: Sequence[tensor_pb2.Tensor],
    payload: bytes | memoryview,
    limits: TensorLimits,
    arrays: dict[str, np.ndarray] | None,
) -> None:
    """Validate `descriptors` against `payload`; with `arrays`, also fill it with the views."""
    payload_len = len(payload)
    if payload_len > limits.max_payload_bytes:
        raise InvalidArgumentError(
            f"payload of {payload_len} bytes exceeds the limit of {limits.max_payload_bytes}"
        )
    if len(descriptors) > limits.max_tensors:
        raise InvalidArgumentError(f"{len(descriptors)} tensors exceed the limit of {limits.max_tensors}")
    keys: set[str] = set()
    spans: list[tuple[int, int, str]] = []
    for desc in descriptors:
        key = desc.key
        if not key:
            raise InvalidArgumentError("a tensor has an empty key")
        if key in keys:
            raise InvalidArgumentError(f"tensor '{key}' appears more than once")
        keys.add(key)
        if desc.encoding not in _ACCEPTED_ENCODINGS:
            raise InvalidArgumentError(f"tensor '{key}': encoding {desc.encoding} is not supported (use RAW)")
        wire = desc.dtype
        offset, length = desc.byte_offset, desc.byte_length
        if wire == tensor_pb2.BYTES:
            elements = _decode_bytes_tensor(desc, payload, limits)
            if arrays is not None:
                arrays[key] = elements
            spans.append((offset, offset + length, key))
            continue
        dtype = _TO_NUMPY.get(wire)
        if dtype is None:
            raise InvalidArgumentError(f"tensor '{key}': unsupported dtype {_dtype_name(wire)}")
        shape = tuple(desc.shape)
        if len(shape) > limits.max_dims:
            raise InvalidArgumentError(
                f"tensor '{key}': {len(shape)} dimensions exceed the limit of {limits.max_dims}"
            )
        if shape and min(shape) < 0:
            raise InvalidArgumentError(f"tensor '{key}': negative dimension in shape {list(shape)}")
        count = math.prod(shape)
        expected = count * dtype.itemsize
        if length != expected:
            raise InvalidArgumentError(
                f"tensor '{key}': byte_length {length} != {expected} "
                f"(shape {list(shape)} x {dtype.itemsize} bytes of {_dtype_name(wire)})"
            )
        end = offset + length
        if end > payload_len:
            raise InvalidArgumentError(
                f"tensor '{key}': bytes [{offset}, {end}) lie outside the {payload_len}-byte payload"
            )
        if length:
            spans.append((offset, end, key))
        if arrays is not None:
            # One constructor call builds the shaped view (half the cost of frombuffer + reshape).
            array = np.ndarray(shape, dtype, payload, offset)
            array.setflags(write=False)  # a view of the request payload: never to be changed in place
            arrays[key] = array
    if len(spans) > 1:
        spans.sort()
        for (_, prev_end, prev_key), (start, _, key) in itertools.pairwise(spans):
            if start < prev_end:
                raise InvalidArgumentError(f"tensors '{prev_key}' and '{key}' overlap in the payload")


def encode_tensors(
    arrays: Mapping[str, np.ndarray],
    *,
    timestamp_ns: int = 0,
) -> tuple[list[tensor_pb2.Tensor], bytes | memoryview]:
    """Descriptors and one payload for `arrays`; a single contiguous array is not copied."""
    descriptors: list[tensor_pb2.Tensor] = []
    parts: list[memoryview] = []
    offset = 0
    for key, value in arrays.items():
        array = np.asarray(value)
        if array.dtype.kind in "OSU":
            data = serialize_bytes(array)
            descriptors.append(
                tensor_pb2.Tensor(
                    key=key,
                    dtype=tensor_pb2.BYTES,
                    shape=array.shape,
                    byte_offset=offset,
                    byte_length=len(data),
                    timestamp_ns=timestamp_ns,
                    encoding=tensor_pb2.RAW,
                )
            )
            parts.append(memoryview(data))
            offset += len(data)
            continue
        if not array.flags.c_contiguous:  # (np.ascontiguousarray would turn a 0-d array into 1-d)
            array = array.copy(order="C")
        wire = wire_dtype(array.dtype)
        view = array.data.cast("B") if array.nbytes else memoryview(b"")
        descriptors.append(
            tensor_pb2.Tensor(
                key=key,
                dtype=wire,  # type: ignore[arg-type]
                shape=array.shape,
                byte_offset=offset,
                byte_length=array.nbytes,
                timestamp_ns=timestamp_ns,
                encoding=tensor_pb2.RAW,
            )
        )
        parts.append(view)
        offset += array.nbytes
    if len(parts) == 1:
        return descriptors, parts[0]
    return descriptors, b"".join(parts)


def serialize_bytes(array: np.ndarray) -> bytes:
    """A BYTES tensor's payload: each element (bytes, or str as UTF-8), C order, length-prefixed."""
    parts: list[bytes] = []
    for element in np.asarray(array, dtype=object).flat:
        if isinstance(element, str):
            data = element.encode()
        elif isinstance(element, bytes | bytearray | memoryview):
            data = bytes(element)
        else:
            raise InvalidArgumentError(
                f"BYTES elements must be bytes or str, not {type(element).__name__} (dtype object)"
            )
        parts += (_LENGTH.pack(len(data)), data)
    return b"".join(parts)


def deserialize_bytes(buffer: bytes | memoryview, count: int, *, name: str = "") -> np.ndarray:
    """`count` length-prefixed elements filling `buffer` exactly -> a 1-d object array of bytes."""
    view = memoryview(buffer).cast("B")
    elements = np.empty(count, dtype=object)
    position = 0
    for index in range(count):
        if position + 4 > len(view):
            raise InvalidArgumentError(f"tensor '{name}': BYTES data ends inside element {index} of {count}")
        (length,) = _LENGTH.unpack_from(view, position)
        position += 4
        if position + length > len(view):
            raise InvalidArgumentError(
                f"tensor '{name}': BYTES element {index} claims {length} bytes past the end of its data"
            )
        elements[index] = bytes(view[position : position + length])
        position += length
    if position != len(view):
        raise InvalidArgumentError(
            f"tensor '{name}': {len(view) - position} bytes left after its {count} BYTES elements"
        )
    return elements


def _decode_bytes_tensor(
    desc: tensor_pb2.Tensor, payload: bytes | memoryview, limits: TensorLimits
) -> np.ndarray:
    key, shape = desc.key, tuple(desc.shape)
    if len(shape) > limits.max_dims:
        raise InvalidArgumentError(
            f"tensor '{key}': {len(shape)} dimensions exceed the limit of {limits.max_dims}"
        )
    if any(dim < 0 for dim in shape):
        raise InvalidArgumentError(f"tensor '{key}': negative dimension in shape {list(shape)}")
    end = desc.byte_offset + desc.byte_length
    if end > len(payload):
        raise InvalidArgumentError(
            f"tensor '{key}': bytes [{desc.byte_offset}, {end}) lie outside the {len(payload)}-byte payload"
        )
    count = math.prod(shape)
    if 4 * count > desc.byte_length:
        raise InvalidArgumentError(
            f"tensor '{key}': byte_length {desc.byte_length} cannot hold {count} BYTES elements"
        )
    view = memoryview(payload).cast("B")[desc.byte_offset : end]
    return deserialize_bytes(view, count, name=key).reshape(shape)
