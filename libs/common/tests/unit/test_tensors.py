"""The tensor codec: descriptors + one payload <-> arrays, and every way an envelope can lie."""

from __future__ import annotations

import numpy as np
import pytest

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.common.tensors import (
    TensorLimits,
    check_tensors,
    decode_tensors,
    encode_tensors,
    has_images,
    numpy_dtype,
    wire_dtype,
)
from loadmaster.v1 import tensor_pb2

WIRE_DTYPES = {
    np.float16: tensor_pb2.DTYPE_FLOAT16,
    np.float32: tensor_pb2.DTYPE_FLOAT32,
    np.float64: tensor_pb2.DTYPE_FLOAT64,
    np.uint8: tensor_pb2.DTYPE_UINT8,
    np.int32: tensor_pb2.DTYPE_INT32,
    np.int64: tensor_pb2.DTYPE_INT64,
    np.bool_: tensor_pb2.DTYPE_BOOL,
}


def sample(dtype: type, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype is np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(size=shape).astype(dtype)


def descriptor(key: str = "x", **fields: object) -> tensor_pb2.Tensor:
    values: dict[str, object] = {
        "dtype": tensor_pb2.DTYPE_FLOAT32,
        "shape": [2],
        "byte_offset": 0,
        "byte_length": 8,
        "encoding": tensor_pb2.ENCODING_RAW,
    }
    values.update(fields)
    return tensor_pb2.Tensor(key=key, **values)  # type: ignore[arg-type]


def assert_rejected(descriptors: list[tensor_pb2.Tensor], payload: bytes, *names: str, **limits: int) -> str:
    """Rejected by decode_tensors, and by check_tensors with the same message."""
    with pytest.raises(InvalidArgumentError) as checked:
        check_tensors(descriptors, payload, TensorLimits(**limits))
    with pytest.raises(InvalidArgumentError) as caught:
        decode_tensors(descriptors, payload, TensorLimits(**limits))
    message = caught.value.message
    assert checked.value.message == message
    for name in names:
        assert f"'{name}'" in message, message
    assert caught.value.edge_code == "invalid_argument"
    return message


# --- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(WIRE_DTYPES), ids=lambda d: np.dtype(d).name)
def test_every_wire_dtype_round_trips(dtype: type) -> None:
    arrays = {"a": sample(dtype, (3, 4), seed=1), "b": sample(dtype, (5,), seed=2)}
    descriptors, payload = encode_tensors(arrays, timestamp_ns=123)
    assert [d.dtype for d in descriptors] == [WIRE_DTYPES[dtype]] * 2
    assert all(d.encoding == tensor_pb2.ENCODING_RAW and d.timestamp_ns == 123 for d in descriptors)
    decoded = decode_tensors(descriptors, bytes(payload))
    assert list(decoded) == ["a", "b"]
    for key, original in arrays.items():
        assert decoded[key].dtype == original.dtype
        assert decoded[key].shape == original.shape
        np.testing.assert_array_equal(decoded[key], original)


def test_mixed_dtypes_share_one_payload_back_to_back() -> None:
    arrays = {np.dtype(d).name: sample(d, (2, 3), seed=i) for i, d in enumerate(WIRE_DTYPES)}
    descriptors, payload = encode_tensors(arrays)
    offset = 0
    for desc, array in zip(descriptors, arrays.values(), strict=True):
        assert (desc.byte_offset, desc.byte_length) == (offset, array.nbytes)
        assert list(desc.shape) == list(array.shape)
        offset += array.nbytes
    assert len(payload) == offset
    decoded = decode_tensors(descriptors, bytes(payload))
    for key, array in arrays.items():
        np.testing.assert_array_equal(decoded[key], array)


@pytest.mark.parametrize("shape", [(0,), (2, 0, 3), (0, 0)])
def test_empty_tensors_round_trip_alone_and_between_others(shape: tuple[int, ...]) -> None:
    empty = np.zeros(shape, dtype=np.float32)
    descriptors, payload = encode_tensors({"empty": empty})
    assert descriptors[0].byte_length == 0 and len(payload) == 0
    assert decode_tensors(descriptors, bytes(payload))["empty"].shape == shape

    arrays = {"a": np.arange(3, dtype=np.int64), "empty": empty, "b": np.ones(2, np.float16)}
    descriptors, payload = encode_tensors(arrays)
    decoded = decode_tensors(descriptors, bytes(payload))
    assert decoded["empty"].shape == shape
    np.testing.assert_array_equal(decoded["a"], arrays["a"])
    np.testing.assert_array_equal(decoded["b"], arrays["b"])


def test_bool_and_float16_keep_their_exact_bits() -> None:
    flags = np.array([True, False, True, True])
    halves = np.array([0.0, -0.0, 65504.0, np.inf, 6.1e-5], dtype=np.float16)
    descriptors, payload = encode_tensors({"flags": flags, "halves": halves})
    decoded = decode_tensors(descriptors, bytes(payload))
    assert decoded["flags"].dtype == np.bool_
    assert bytes(decoded["flags"]) == flags.tobytes()
    assert decoded["halves"].tobytes() == halves.tobytes()  # -0.0 and inf survive bit for bit


def test_non_contiguous_arrays_are_encoded_in_logical_order() -> None:
    base = np.arange(24, dtype=np.int32).reshape(4, 6)
    arrays = {"t": base.T, "s": base[:, ::2]}
    descriptors, payload = encode_tensors(arrays)
    decoded = decode_tensors(descriptors, bytes(payload))
    np.testing.assert_array_equal(decoded["t"], base.T)
    np.testing.assert_array_equal(decoded["s"], base[:, ::2])


def test_a_single_contiguous_array_is_not_copied() -> None:
    array = np.arange(16, dtype=np.float32)
    _, payload = encode_tensors({"x": array})
    assert np.shares_memory(np.frombuffer(payload, dtype=np.uint8), array)


def test_bfloat16_decodes_as_its_raw_16_bit_words() -> None:
    words = np.array([0x3F80, 0xC000], dtype=np.uint16)  # 1.0, -2.0 in bfloat16
    desc = descriptor(dtype=tensor_pb2.DTYPE_BFLOAT16, shape=[2], byte_length=4)
    decoded = decode_tensors([desc], words.tobytes())["x"]
    assert decoded.dtype == np.uint16
    np.testing.assert_array_equal(decoded, words)


def test_zero_dimensional_tensors_keep_their_shape() -> None:
    descriptors, payload = encode_tensors({"scalar": np.array(2.5, dtype=np.float32)})
    assert list(descriptors[0].shape) == []
    assert decode_tensors(descriptors, bytes(payload))["scalar"].shape == ()


# --- zero-copy, read-only views -------------------------------------------------------------


def test_decode_returns_zero_copy_read_only_views_of_bytes() -> None:
    arrays = {"a": np.arange(6, dtype=np.float64).reshape(2, 3), "b": np.arange(4, dtype=np.uint8)}
    descriptors, payload = encode_tensors(arrays)
    payload = bytes(payload)
    raw = np.frombuffer(payload, dtype=np.uint8)
    decoded = decode_tensors(descriptors, payload)
    for array in decoded.values():
        assert np.shares_memory(array, raw)
        assert not array.flags.writeable
        with pytest.raises(ValueError):
            array[...] = 0


def test_decode_views_a_memoryview_payload_without_copying() -> None:
    backing = bytearray(np.arange(4, dtype=np.int32).tobytes())
    decoded = decode_tensors(
        [descriptor(dtype=tensor_pb2.DTYPE_INT32, shape=[4], byte_length=16)], memoryview(backing)
    )
    backing[0:4] = np.int32(99).tobytes()
    assert decoded["x"][0] == 99  # a view of the caller's buffer, not a copy


@pytest.mark.parametrize("kind", ["bytearray", "encoded-memoryview"])
def test_decode_views_are_read_only_even_over_writable_buffers(kind: str) -> None:
    array = np.arange(4, dtype=np.float32)
    descriptors, payload = encode_tensors({"x": array})
    buffer = memoryview(bytearray(payload)) if kind == "bytearray" else payload
    decoded = decode_tensors(descriptors, buffer)
    assert not decoded["x"].flags.writeable


# --- validation: each error names the tensor ------------------------------------------------


def test_wrong_byte_length_is_rejected() -> None:
    message = assert_rejected([descriptor("img", shape=[2, 2], byte_length=12)], bytes(16), "img")
    assert "byte_length 12" in message and "16" in message


@pytest.mark.parametrize(("offset", "length", "shape"), [(8, 8, [2]), (0, 24, [6]), (100, 0, [0])])
def test_bytes_outside_the_payload_are_rejected(offset: int, length: int, shape: list[int]) -> None:
    desc = descriptor("state", byte_offset=offset, byte_length=length, shape=shape)
    message = assert_rejected([desc], bytes(12), "state")
    assert "outside" in message


def test_overlapping_tensors_are_rejected_naming_both() -> None:
    first = descriptor("left", shape=[4], byte_length=16, byte_offset=0)
    second = descriptor("right", shape=[2], byte_length=8, byte_offset=12)
    assert "overlap" in assert_rejected([first, second], bytes(32), "left", "right")
    # order of descriptors does not matter
    assert "overlap" in assert_rejected([second, first], bytes(32), "left", "right")


def test_adjacent_tensors_do_not_overlap() -> None:
    first = descriptor("left", shape=[2], byte_length=8, byte_offset=0)
    second = descriptor("right", shape=[2], byte_length=8, byte_offset=8)
    assert set(decode_tensors([second, first], bytes(16))) == {"left", "right"}


def test_duplicate_keys_are_rejected() -> None:
    first = descriptor("obs", byte_offset=0)
    second = descriptor("obs", byte_offset=8)
    assert "more than once" in assert_rejected([first, second], bytes(16), "obs")


def test_empty_keys_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="empty key"):
        decode_tensors([descriptor("")], bytes(8))


@pytest.mark.parametrize("dtype", [tensor_pb2.DTYPE_UNSPECIFIED, 42])
def test_unknown_dtypes_are_rejected(dtype: int) -> None:
    message = assert_rejected([descriptor("depth", dtype=dtype)], bytes(8), "depth")
    assert "dtype" in message


def test_too_many_tensors_are_rejected() -> None:
    descriptors = [descriptor(f"t{i}", byte_offset=8 * i) for i in range(3)]
    assert decode_tensors(descriptors, bytes(24), TensorLimits(max_tensors=3))
    message = assert_rejected(descriptors, bytes(24), max_tensors=2)
    assert "3 tensors" in message and "2" in message


def test_too_many_dimensions_are_rejected() -> None:
    desc = descriptor("volume", shape=[1, 1, 1, 2], byte_length=8)
    assert decode_tensors([desc], bytes(8), TensorLimits(max_dims=4))["volume"].shape == (1, 1, 1, 2)
    message = assert_rejected([desc], bytes(8), "volume", max_dims=3)
    assert "4 dimensions" in message


def test_payload_over_the_limit_is_rejected() -> None:
    desc = descriptor("x", shape=[4], byte_length=16)
    assert decode_tensors([desc], bytes(16), TensorLimits(max_payload_bytes=16))
    message = assert_rejected([desc], bytes(17), max_payload_bytes=16)
    assert "17 bytes" in message and "16" in message


def test_negative_dimensions_are_rejected() -> None:
    # -2 x -1 x 4 bytes = 8 = byte_length: only the sign check can catch it
    desc = descriptor("pose", shape=[-2, -1], byte_length=8)
    assert "negative" in assert_rejected([desc], bytes(8), "pose")


def test_unknown_encodings_are_rejected() -> None:
    message = assert_rejected([descriptor("camera", encoding=9)], bytes(8), "camera")
    assert "encoding 9" in message


def image(key: str = "camera", **fields: object) -> tensor_pb2.Tensor:
    values: dict[str, object] = {
        "dtype": tensor_pb2.DTYPE_UINT8,
        "shape": [480, 640, 3],
        "byte_length": 100,
        "encoding": tensor_pb2.ENCODING_JPEG,
    }
    values.update(fields)
    return descriptor(key, **values)


@pytest.mark.parametrize("encoding", [tensor_pb2.ENCODING_JPEG, tensor_pb2.ENCODING_PNG])
def test_image_tensors_pass_the_cheap_checks_and_need_a_decoder(encoding: int) -> None:
    desc = image(encoding=encoding)
    assert check_tensors([desc], bytes(100)) is None  # the gateway forwards it undecoded
    with pytest.raises(InvalidArgumentError, match=r"'camera'.*decoded by model workers"):
        decode_tensors([desc], bytes(100))
    seen: list[tuple[str, bytes]] = []

    def decode(d: tensor_pb2.Tensor, data: memoryview) -> np.ndarray:
        seen.append((d.key, bytes(data)))
        return np.zeros(tuple(d.shape), np.uint8)

    payload = bytes(range(50)) * 3
    desc.byte_offset = 20
    arrays = decode_tensors([desc], payload, decode_image=decode)
    assert arrays["camera"].shape == (480, 640, 3)
    assert seen == [("camera", payload[20:120])]  # the compressed slice, nothing else


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"dtype": tensor_pb2.DTYPE_FLOAT32}, "UINT8"),
        ({"shape": [480, 640]}, "[height, width, channels]"),
        ({"shape": [480, 640, 2]}, "channels 1, 3 or 4"),
        ({"shape": [0, 640, 3]}, "[height, width, channels]"),
        ({"shape": [8000, 8000, 3]}, "exceed the limit"),
        ({"byte_length": 0}, "byte_length 0"),
        ({"byte_length": 101}, "outside the 100-byte payload"),
    ],
)
def test_bad_image_descriptors_are_refused_naming_the_tensor(
    fields: dict[str, object], expected: str
) -> None:
    message = assert_rejected([image(**fields)], bytes(100), "camera", max_image_pixels=40_000_000)
    assert expected in message


def test_has_images() -> None:
    assert has_images([descriptor("x"), image()])
    assert not has_images([descriptor("x"), descriptor("y", encoding=tensor_pb2.ENCODING_UNSPECIFIED)])


def test_an_image_overlapping_another_tensor_is_refused() -> None:
    message = assert_rejected([descriptor("x"), image(byte_offset=4, byte_length=8)], bytes(100))
    assert "overlap" in message


def test_check_accepts_what_decode_accepts_without_building_arrays() -> None:
    descriptors, payload = encode_tensors({"img": np.zeros((2, 3), np.uint8), "s": np.array([b"ab"])})
    assert check_tensors(descriptors, memoryview(bytes(payload))) is None
    assert set(decode_tensors(descriptors, bytes(payload))) == {"img", "s"}


def test_unspecified_encoding_is_taken_as_raw() -> None:
    desc = descriptor("x", encoding=tensor_pb2.ENCODING_UNSPECIFIED)
    values = np.array([1.5, 2.5], dtype=np.float32)
    np.testing.assert_array_equal(decode_tensors([desc], values.tobytes())["x"], values)


# --- dtype mapping --------------------------------------------------------------------------


def test_dtype_mapping_is_a_bijection_over_the_wire_dtypes() -> None:
    for dtype, wire in WIRE_DTYPES.items():
        assert wire_dtype(np.dtype(dtype)) == wire
        assert numpy_dtype(wire) == np.dtype(dtype)


@pytest.mark.parametrize("dtype", [np.int16, np.complex64, np.uint32])
def test_dtypes_without_a_wire_form_cannot_be_encoded(dtype: type) -> None:
    with pytest.raises(InvalidArgumentError, match=np.dtype(dtype).name):
        encode_tensors({"x": np.zeros(2, dtype=dtype)})


def test_numpy_dtype_rejects_unknown_wire_values() -> None:
    with pytest.raises(InvalidArgumentError, match="unsupported dtype 42"):
        numpy_dtype(42)


# ---- BYTES (KServe layout: 4-byte little-endian length before each element) ----------


def test_bytes_tensors_round_trip_with_their_shape() -> None:
    from loadmaster.common.tensors import decode_tensors as decode
    from loadmaster.common.tensors import encode_tensors as encode

    strings = np.array([[b"ab", b""], [b"xyz", "\u00e9".encode()]], dtype=object)
    descriptors, payload = encode({"s": strings, "x": np.arange(3, dtype=np.float32)})
    assert descriptors[0].dtype == tensor_pb2.DTYPE_BYTES
    assert descriptors[0].byte_length == 4 * 4 + 2 + 0 + 3 + 2
    decoded = decode(descriptors, bytes(payload))
    assert decoded["s"].shape == (2, 2)
    assert decoded["s"].tolist() == strings.tolist()
    np.testing.assert_array_equal(decoded["x"], np.arange(3, dtype=np.float32))


def test_str_elements_travel_as_utf8() -> None:
    from loadmaster.common.tensors import decode_tensors as decode
    from loadmaster.common.tensors import encode_tensors as encode

    descriptors, payload = encode({"s": np.array(["héllo"])})
    assert decode(descriptors, bytes(payload))["s"].tolist() == ["héllo".encode()]


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_bytes_coded_in_steps_keep_every_element_across_step_edges(
    step: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loadmaster.common import tensors

    monkeypatch.setattr(tensors, "ELEMENTS_PER_STEP", step)
    elements = [b"x" * (i % 5) for i in range(40)] + ["\u00e9t\u00e9"] * 9 + [b""] * 11
    expected = [e.encode() if isinstance(e, str) else e for e in elements]
    data = tensors.serialize_bytes(np.array(elements, dtype=object))
    assert data == _bytes_payload(expected)
    assert tensors.deserialize_bytes(memoryview(data), len(expected)).tolist() == expected
    assert tensors.deserialize_bytes(data, len(expected)).tolist() == expected
    assert tensors.deserialize_bytes(memoryview(b""), 0).tolist() == []


def test_bytes_decoding_of_a_view_never_copies_it_whole() -> None:
    """A 16 MiB view of 1 KiB elements: the elements are the one copy made (before, the whole
    view was first copied into one bytes object, doubling the peak; 128 MiB for 64 MiB)."""
    import tracemalloc

    from loadmaster.common.tensors import deserialize_bytes

    count, size = 16 << 10, 1020
    rows = np.empty((count, 4 + size), np.uint8)
    rows[:, :4] = np.frombuffer(np.uint32(size).tobytes(), np.uint8)
    rows[:, 4:] = ord("a")
    view = memoryview(rows).cast("B")
    tracemalloc.start()
    try:
        elements = deserialize_bytes(view, count)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elements[-1] == b"a" * size
    assert peak < 1.5 * view.nbytes, peak


@pytest.mark.parametrize(
    ("data", "count", "problem"),
    [
        (b"\x05\x00\x00\x00abc", 1, "past the end"),
        (b"\x01\x00\x00\x00a\x00", 1, "left after"),
        (b"\x01\x00\x00\x00a", 2, "cannot hold|ends inside"),
    ],
)
def test_malformed_bytes_data_names_the_tensor(data: bytes, count: int, problem: str) -> None:
    from loadmaster.common.tensors import decode_tensors as decode

    desc = tensor_pb2.Tensor(
        key="text", dtype=tensor_pb2.DTYPE_BYTES, shape=[count], byte_offset=0, byte_length=len(data)
    )
    with pytest.raises(InvalidArgumentError, match=rf"'text'.*({problem})"):
        decode([desc], data)
    with pytest.raises(InvalidArgumentError, match=rf"'text'.*({problem})"):
        check_tensors([desc], data)


def test_object_arrays_of_anything_but_bytes_or_str_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"bytes or str, not int.*object"):
        encode_tensors({"x": np.zeros(2, dtype=object)})


# ---- boundaries, shapes numpy cannot build, and BYTES at scale ------------------------------


@pytest.mark.parametrize(("dtype", "shape"), [(tensor_pb2.DTYPE_UINT8, [8]), (tensor_pb2.DTYPE_FLOAT32, [2])])
def test_a_tensor_ending_exactly_at_the_payload_end_passes_and_one_byte_further_does_not(
    dtype: int, shape: list[int]
) -> None:
    inside = descriptor("edge", dtype=dtype, shape=shape, byte_offset=1, byte_length=8)
    assert check_tensors([inside], bytes(9)) is None
    assert decode_tensors([inside], bytes(9))["edge"].nbytes == 8
    message = assert_rejected([inside], bytes(8), "edge")
    assert "[1, 9)" in message and "8-byte payload" in message


def test_a_bytes_tensor_ending_one_byte_past_the_payload_is_rejected() -> None:
    element = b"\x01\x00\x00\x00a"
    desc = tensor_pb2.Tensor(
        key="text", dtype=tensor_pb2.DTYPE_BYTES, shape=[1], byte_offset=1, byte_length=5
    )
    assert decode_tensors([desc], b"\x00" + element)["text"].tolist() == [b"a"]
    assert "outside" in assert_rejected([desc], element, "text")


@pytest.mark.parametrize("dtype", [tensor_pb2.DTYPE_FLOAT32, tensor_pb2.DTYPE_BYTES])
def test_an_empty_shape_too_large_for_numpy_is_invalid_argument(dtype: int) -> None:
    desc = descriptor("huge", dtype=dtype, shape=[0, 2**62], byte_length=0)
    message = assert_rejected([desc], b"", "huge")
    assert "too large" in message


def test_bytes_element_count_is_limited_before_walking_the_data() -> None:
    data = b"\x00\x00\x00\x00" * 10
    desc = tensor_pb2.Tensor(key="words", dtype=tensor_pb2.DTYPE_BYTES, shape=[10], byte_length=len(data))
    assert decode_tensors([desc], data, TensorLimits(max_bytes_elements=10))["words"].tolist() == [b""] * 10
    message = assert_rejected([desc], data, "words", max_bytes_elements=9)
    assert "10 BYTES elements exceed the limit of 9" in message


def _bytes_payload(elements: list[bytes]) -> bytes:
    return b"".join(len(e).to_bytes(4, "little") + e for e in elements)


@pytest.mark.parametrize(
    "elements",
    [
        [b"abc"] * 1000,  # one uniform run, walked in doubling numpy windows
        [b""] * 999 + [b"tail"],  # a run broken by its last element
        [b"x" * (i % 3) for i in range(500)],  # lengths that never repeat 8 times in a row
        [b"a"] * 40 + [b"bb"] * 3 + [b"a"] * 100 + [b"\x00\x00"] * 17,  # runs of many lengths
        [b"\x00" * 5],
    ],
    ids=["uniform", "run-then-tail", "varying", "mixed-runs", "trailing-nulls"],
)
def test_bytes_decoding_keeps_every_element_exactly(elements: list[bytes]) -> None:
    from loadmaster.common.tensors import deserialize_bytes, serialize_bytes

    data = _bytes_payload(elements)
    assert serialize_bytes(np.array(elements, dtype=object)) == data
    desc = tensor_pb2.Tensor(
        key="s", dtype=tensor_pb2.DTYPE_BYTES, shape=[len(elements)], byte_length=len(data)
    )
    assert decode_tensors([desc], data)["s"].tolist() == elements
    assert deserialize_bytes(memoryview(data), len(elements)).tolist() == elements
    check_tensors([desc], data)


@pytest.mark.parametrize(
    ("data", "count", "problem"),
    [
        (_bytes_payload([b"ab"] * 20) + b"\x02\x00\x00\x00a", 21, "element 20 claims 2 bytes past the end"),
        (_bytes_payload([b"ab"] * 20) + b"\x02\x00", 21, "ends inside element 20 of 21"),
        (_bytes_payload([b"ab"] * 20) + b"\x00", 20, "1 bytes left after its 20"),
        (_bytes_payload([b""] * 30), 29, "4 bytes left after its 29"),
    ],
)
def test_malformed_runs_are_named_like_single_elements(data: bytes, count: int, problem: str) -> None:
    desc = tensor_pb2.Tensor(key="text", dtype=tensor_pb2.DTYPE_BYTES, shape=[count], byte_length=len(data))
    assert problem in assert_rejected([desc], data, "text")
