"""Tensor codec: descriptors + one binary payload <-> `dict[str, np.ndarray]`.

Decoding returns read-only zero-copy views into the payload after checking every
descriptor against it (offsets, lengths, dtype x shape, overlaps, limits), so a
bad envelope is answered `invalid_argument` naming the tensor, never a crash.

Image tensors (encoding JPEG or PNG) describe their decoded pixels: dtype UINT8 and shape
[H, W, C] with C in 1, 3, 4, while their payload slice holds the compressed bytes. Only
the cheap checks happen here (shape, pixel count, lengths); decoding them needs an
`ImageDecode` (the model worker's, loadmaster.model_pool.images), so a hop that only
forwards the payload never decodes.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.v1 import tensor_pb2

__all__ = [
    "ELEMENTS_PER_STEP",
    "IMAGE_CHANNELS",
    "IMAGE_ENCODINGS",
    "ImageDecode",
    "TensorLimits",
    "bytes_element_spans",
    "check_bytes",
    "check_tensors",
    "decode_tensors",
    "deserialize_bytes",
    "encode_tensors",
    "has_images",
    "numpy_dtype",
    "serialize_bytes",
    "shape_elements_at_most",
    "wire_dtype",
]

_SHAPE_SCAN_DIMS = 64  # far above any dimension limit: a longer shape is refused later anyway


def shape_elements_at_most(shape: Sequence[int], cap: int) -> int:
    """How many elements `shape` claims, counted only up to `cap` (a larger count, or a shape
    too long to be valid, answers `cap + 1`). Constant work whatever a client sends: a shape of
    200,000 dimensions must not cost a multiplication each on an event loop."""
    if len(shape) > _SHAPE_SCAN_DIMS:
        return cap + 1
    total = 1
    for dim in shape:
        total *= max(int(dim), 0)
        if total > cap:
            return cap + 1
    return total


# BFLOAT16 has no numpy dtype: its raw 2-byte words travel as uint16.
_TO_NUMPY: dict[int, np.dtype] = {
    tensor_pb2.DTYPE_FLOAT16: np.dtype(np.float16),
    tensor_pb2.DTYPE_FLOAT32: np.dtype(np.float32),
    tensor_pb2.DTYPE_FLOAT64: np.dtype(np.float64),
    tensor_pb2.DTYPE_BFLOAT16: np.dtype(np.uint16),
    tensor_pb2.DTYPE_UINT8: np.dtype(np.uint8),
    tensor_pb2.DTYPE_INT32: np.dtype(np.int32),
    tensor_pb2.DTYPE_INT64: np.dtype(np.int64),
    tensor_pb2.DTYPE_BOOL: np.dtype(np.bool_),
}
_FROM_NUMPY: dict[np.dtype, int] = {
    dtype: wire for wire, dtype in _TO_NUMPY.items() if wire != tensor_pb2.DTYPE_BFLOAT16
}
_ACCEPTED_ENCODINGS = (tensor_pb2.ENCODING_UNSPECIFIED, tensor_pb2.ENCODING_RAW)
IMAGE_ENCODINGS = frozenset({tensor_pb2.ENCODING_JPEG, tensor_pb2.ENCODING_PNG})
IMAGE_CHANNELS = (1, 3, 4)  # gray, RGB, RGBA
_ENCODING_NAMES = {tensor_pb2.ENCODING_JPEG: "JPEG", tensor_pb2.ENCODING_PNG: "PNG"}
# Decodes one image tensor (its descriptor, its compressed bytes) to uint8 [H, W, C] pixels,
# checked against the descriptor; raises InvalidArgumentError naming the tensor.
ImageDecode = Callable[[tensor_pb2.Tensor, memoryview], np.ndarray]
_LENGTH = struct.Struct("<I")  # BYTES element prefix


@dataclass(frozen=True, slots=True)
class TensorLimits:
    max_payload_bytes: int = 64 << 20
    max_tensors: int = 64
    max_dims: int = 8
    max_bytes_elements: int = 1 << 20  # elements of one BYTES tensor: bounds the per-element work
    max_image_pixels: int = 40_000_000  # H x W of one JPEG/PNG tensor: bounds its decode


def numpy_dtype(wire: int) -> np.dtype:
    if wire == tensor_pb2.DTYPE_BYTES:
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
        return tensor_pb2.DTYPE_BYTES
    try:
        return _FROM_NUMPY[np.dtype(dtype)]
    except KeyError:
        supported = ", ".join(sorted(d.name for d in _FROM_NUMPY))
        raise InvalidArgumentError(
            f"dtype {np.dtype(dtype).name} cannot travel on the wire (supported: {supported})"
        ) from None


def _dtype_name(wire: int) -> str:
    try:
        return tensor_pb2.Dtype.Name(wire)
    except ValueError:
        return str(wire)


def decode_tensors(
    descriptors: Sequence[tensor_pb2.Tensor],
    payload: bytes | memoryview,
    limits: TensorLimits = TensorLimits(),
    *,
    decode_image: ImageDecode | None = None,
) -> dict[str, np.ndarray]:
    """Validate `descriptors` against `payload` and return read-only views, keyed by tensor key.

    Image tensors are decoded by `decode_image`; without one they are refused."""
    arrays: dict[str, np.ndarray] = {}
    _check(descriptors, payload, limits, arrays, decode_image)
    return arrays


def has_images(descriptors: Sequence[tensor_pb2.Tensor]) -> bool:
    """Whether any descriptor is a compressed image (JPEG or PNG)."""
    for desc in descriptors:  # noqa: SIM110 (a loop: on every request that reaches a worker)
        if desc.encoding > tensor_pb2.ENCODING_RAW:
            return True
    return False


def check_tensors(
    descriptors: Sequence[tensor_pb2.Tensor],
    payload: bytes | memoryview,
    limits: TensorLimits = TensorLimits(),
) -> None:
    """Every check of `decode_tensors`, with the same errors, without building the arrays: for
    a hop that only forwards the payload (the gateway), views it would never read are waste."""
    _check(descriptors, payload, limits, None, None)


def _check(
    descriptors: Sequence[tensor_pb2.Tensor],
    payload: bytes | memoryview,
    limits: TensorLimits,
    arrays: dict[str, np.ndarray] | None,
    decode_image: ImageDecode | None,
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
    images: list[tensor_pb2.Tensor] = []
    for desc in descriptors:
        key = desc.key
        if not key:
            raise InvalidArgumentError("a tensor has an empty key")
        if key in keys:
            raise InvalidArgumentError(f"tensor '{key}' appears more than once")
        keys.add(key)
        wire = desc.dtype
        offset, length = desc.byte_offset, desc.byte_length
        if desc.encoding not in _ACCEPTED_ENCODINGS:
            _check_image(desc, payload_len, limits)
            spans.append((offset, offset + length, key))
            images.append(desc)  # decoded once every descriptor has passed its checks
            continue
        if wire == tensor_pb2.DTYPE_BYTES:
            elements = _decode_bytes_tensor(desc, payload, limits, build=arrays is not None)
            if arrays is not None and elements is not None:
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
        count = _element_count(key, shape, limits)
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
    if arrays is not None:
        for desc in images:
            if decode_image is None:
                raise InvalidArgumentError(
                    f"tensor '{desc.key}': {_ENCODING_NAMES[desc.encoding]} tensors are decoded by model workers"
                )
            start = desc.byte_offset
            arrays[desc.key] = decode_image(
                desc, memoryview(payload).cast("B")[start : start + desc.byte_length]
            )


def _check_image(desc: tensor_pb2.Tensor, payload_len: int, limits: TensorLimits) -> None:
    """The cheap checks of a compressed image tensor: what it claims, and where its bytes lie."""
    key = desc.key
    name = _ENCODING_NAMES.get(desc.encoding)
    if name is None:
        raise InvalidArgumentError(
            f"tensor '{key}': encoding {desc.encoding} is not supported (RAW, JPEG or PNG)"
        )
    if desc.dtype != tensor_pb2.DTYPE_UINT8:
        raise InvalidArgumentError(
            f"tensor '{key}': a {name} tensor has dtype UINT8 (its decoded pixels), not {_dtype_name(desc.dtype)}"
        )
    shape = tuple(desc.shape)
    if len(shape) != 3 or shape[2] not in IMAGE_CHANNELS or shape[0] <= 0 or shape[1] <= 0:
        raise InvalidArgumentError(
            f"tensor '{key}': a {name} tensor has the decoded shape [height, width, channels] "
            f"with channels 1, 3 or 4, not {list(shape)}"
        )
    if shape[0] * shape[1] > limits.max_image_pixels:
        raise InvalidArgumentError(
            f"tensor '{key}': {shape[0]} x {shape[1]} pixels exceed the limit of {limits.max_image_pixels}"
        )
    end = desc.byte_offset + desc.byte_length
    if desc.byte_length == 0:
        raise InvalidArgumentError(
            f"tensor '{key}': a {name} tensor needs its compressed bytes (byte_length 0)"
        )
    if end > payload_len:
        raise InvalidArgumentError(
            f"tensor '{key}': bytes [{desc.byte_offset}, {end}) lie outside the {payload_len}-byte payload"
        )


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
                    dtype=tensor_pb2.DTYPE_BYTES,
                    shape=array.shape,
                    byte_offset=offset,
                    byte_length=len(data),
                    timestamp_ns=timestamp_ns,
                    encoding=tensor_pb2.ENCODING_RAW,
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
                encoding=tensor_pb2.ENCODING_RAW,
            )
        )
        parts.append(view)
        offset += array.nbytes
    if len(parts) == 1:
        return descriptors, parts[0]
    return descriptors, b"".join(parts)


# BYTES elements handled per step of `serialize_bytes` / `deserialize_bytes`: each step runs in C
# holding the GIL, and a thread switch can only happen between steps, so a 64 MiB tensor coded
# on a worker thread lets the event loop run every few milliseconds rather than stalling it.
ELEMENTS_PER_STEP = 1024


def serialize_bytes(array: np.ndarray) -> bytes:
    """A BYTES tensor's payload: each element (bytes, or str as UTF-8), C order, length-prefixed.

    The per-element work runs inside C iterators (`map`, `bytes.join`), not Python bytecode,
    `ELEMENTS_PER_STEP` elements at a time."""
    flat = np.asarray(array, dtype=object).reshape(-1)
    pieces = [
        _serialize_step(flat[first : first + ELEMENTS_PER_STEP].tolist())
        for first in range(0, flat.size, ELEMENTS_PER_STEP)
    ]
    if len(pieces) == 1:
        return pieces[0]
    return b"".join(pieces)  # (joining bytes objects copies without holding the GIL)


def _serialize_step(flat: list[object]) -> bytes:
    kinds = set(map(type, flat))
    if kinds <= {bytes}:
        data: list[bytes] = flat  # type: ignore[assignment]
    elif kinds <= {str}:
        data = list(map(str.encode, flat))  # type: ignore[arg-type]
    else:
        data = list(map(_element_bytes, flat))
    parts: list[bytes] = [b""] * (2 * len(data))
    parts[0::2] = map(_LENGTH.pack, map(len, data))
    parts[1::2] = data
    return b"".join(parts)


def _element_bytes(element: object) -> bytes:
    if isinstance(element, str):
        return element.encode()
    if isinstance(element, bytes | bytearray | memoryview):
        return bytes(element)
    raise InvalidArgumentError(
        f"BYTES elements must be bytes or str, not {type(element).__name__} (dtype object)"
    )


def deserialize_bytes(buffer: bytes | memoryview, count: int, *, name: str = "") -> np.ndarray:
    """`count` length-prefixed elements filling `buffer` exactly -> a 1-d object array of bytes.

    Built `ELEMENTS_PER_STEP` elements at a time, each step from a copy of only its own span
    (a memoryview is never copied whole)."""
    view = buffer if isinstance(buffer, bytes) else memoryview(buffer).cast("B")
    starts, lengths = bytes_element_spans(view, count, name=name)
    ends = starts + lengths
    elements = np.empty(count, dtype=object)
    for first in range(0, count, ELEMENTS_PER_STEP):
        last = min(first + ELEMENTS_PER_STEP, count)
        low = int(starts[first])
        # slicing `bytes` makes each element in one C call: no Python bytecode per element
        span = view[low : int(ends[last - 1])]
        whole = span if isinstance(span, bytes) else span.tobytes()
        elements[first:last] = list(
            map(
                whole.__getitem__,
                map(slice, (starts[first:last] - low).tolist(), (ends[first:last] - low).tolist()),
            )
        )
    return elements


def bytes_element_spans(
    buffer: bytes | memoryview, count: int, *, name: str = ""
) -> tuple[np.ndarray, np.ndarray]:
    """Where each of `count` length-prefixed elements lies in `buffer`: (data starts, lengths).

    Raises `InvalidArgumentError` naming the tensor unless the elements fill `buffer` exactly."""
    view = memoryview(buffer).cast("B")
    prefixes = np.array(_walk_bytes(view, count, name, keep=True), dtype=np.int64)
    octets = np.frombuffer(view, np.uint8)
    lengths = np.zeros(len(prefixes), np.int64)
    for byte in range(4):  # the little-endian prefixes, gathered a byte at a time
        lengths |= octets[prefixes + byte].astype(np.int64) << (8 * byte)
    return prefixes + 4, lengths


def check_bytes(buffer: bytes | memoryview, count: int, *, name: str = "") -> None:
    """The checks of `deserialize_bytes` (the same errors) without building anything."""
    _walk_bytes(memoryview(buffer).cast("B"), count, name, keep=False)


_RUN_AFTER = 8  # equal lengths in a row after which the walk tries a vectorised run


def _walk_bytes(view: memoryview, count: int, name: str, *, keep: bool) -> list[int]:
    """Walk `count` length-prefixed elements that must fill `view`; with `keep`, return where
    each element's prefix starts.

    Runs of equal lengths are checked as one strided numpy view of their prefixes, in windows
    that double while the lengths hold (`_uniform_run`), so uniform data (fixed-size records,
    empty strings, one large element) costs a few numpy calls whatever its size. Where lengths
    vary, one step per element: the caller bounds `count` (`TensorLimits.max_bytes_elements`).
    """
    size = len(view)
    unpack = _LENGTH.unpack_from
    prefixes: list[int] = []
    index = position = same = 0
    previous = -1
    while index < count:
        if position + 4 > size:
            raise InvalidArgumentError(f"tensor '{name}': BYTES data ends inside element {index} of {count}")
        (length,) = unpack(view, position)
        end = position + 4 + length
        if end > size:
            raise InvalidArgumentError(
                f"tensor '{name}': BYTES element {index} claims {length} bytes past the end of its data"
            )
        if length != previous:
            previous, same = length, 0
        else:
            same += 1
            if same >= _RUN_AFTER:
                fits = min(count - index, (size - position) // (4 + length))
                run = _uniform_run(view, position, length=length, fits=fits)
                if keep:
                    prefixes.extend(range(position, position + run * (4 + length), 4 + length))
                index += run
                position += run * (4 + length)
                same = 0
                continue
        if keep:
            prefixes.append(position)
        index += 1
        position = end
    if position != size:
        raise InvalidArgumentError(
            f"tensor '{name}': {size - position} bytes left after its {count} BYTES elements"
        )
    return prefixes


def _uniform_run(view: memoryview, position: int, *, length: int, fits: int) -> int:
    """How many elements from `position` on (at most `fits`, all known to lie inside `view`)
    carry a prefix equal to `length`; the first one is known to."""
    stride = 4 + length
    checked, window = 1, 16
    while checked < fits:
        take = min(window, fits - checked)
        prefixes = np.ndarray((take,), "<u4", view, position + checked * stride, (stride,))
        differs = np.flatnonzero(prefixes != length)
        if differs.size:
            return checked + int(differs[0])
        checked += take
        window *= 2
    return fits


def _decode_bytes_tensor(
    desc: tensor_pb2.Tensor, payload: bytes | memoryview, limits: TensorLimits, *, build: bool
) -> np.ndarray | None:
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
    count = _element_count(key, shape, limits)
    if count > limits.max_bytes_elements:
        raise InvalidArgumentError(
            f"tensor '{key}': {count} BYTES elements exceed the limit of {limits.max_bytes_elements}"
        )
    if 4 * count > desc.byte_length:
        raise InvalidArgumentError(
            f"tensor '{key}': byte_length {desc.byte_length} cannot hold {count} BYTES elements"
        )
    view = memoryview(payload).cast("B")[desc.byte_offset : end]
    if not build:
        check_bytes(view, count, name=key)
        return None
    return deserialize_bytes(view, count, name=key).reshape(shape)


def _element_count(key: str, shape: tuple[int, ...], limits: TensorLimits) -> int:
    """The number of elements of `shape`, refusing shapes no payload within the limits can back:
    numpy cannot build `[0, 2**62]` even though it holds no element."""
    extent = math.prod(dim for dim in shape if dim)
    if extent > limits.max_payload_bytes:
        raise InvalidArgumentError(
            f"tensor '{key}': shape {list(shape)} is too large (its non-zero dimensions multiply to "
            f"{extent}, more than the payload limit of {limits.max_payload_bytes} bytes)"
        )
    return 0 if 0 in shape else extent
