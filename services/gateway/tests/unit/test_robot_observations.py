"""Robot observation dicts <-> calls (openpi and GR00T front ends), and their wire codings."""

from __future__ import annotations

import io

import msgpack
import numpy as np
import pytest

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.common.gateway_config import LimitsSettings
from loadmaster.common.tensors import decode_tensors, encode_tensors
from loadmaster.gateway.calls import CallResult
from loadmaster.gateway.frontends import gr00t, openpi
from loadmaster.gateway.frontends.observations import (
    CallOptions,
    action_dict,
    flatten,
    observation_call,
    parse_options,
    unflatten,
)
from loadmaster.v1 import model_pool_pb2, tensor_pb2

OPTIONS = CallOptions(client_id="arm-1", client_type="openpi", priority=0, urgency=0.5, timeout_ms=50.0)
POLICY = model_pool_pb2.ModelSignature(
    model_id="policy",
    inputs=[
        model_pool_pb2.TensorSpec(name="state", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[-1, 32]),
        model_pool_pb2.TensorSpec(name="prompt", dtype=tensor_pb2.DTYPE_BYTES, any_shape=True),
    ],
)


def call(observation: dict[str, object], signature: model_pool_pb2.ModelSignature | None = POLICY):
    return observation_call(
        observation, signature, model_id="policy", request_id="r1", options=OPTIONS, limits=LimitsSettings()
    )


def test_flatten_and_unflatten_on_slashes() -> None:
    nested = {"video": {"ego": 1, "wrist": 2}, "state": {"arm": {"joints": 3}}, "prompt": 4}
    flat = flatten(nested)
    assert flat == {"video/ego": 1, "video/wrist": 2, "state/arm/joints": 3, "prompt": 4}
    assert unflatten(flat) == nested
    assert unflatten({"a": 1, "a/b": 2}) == {"a": 1, "a/b": 2}  # a leaf and a prefix: kept whole
    assert flatten({b"raw": 1}) == {"raw": 1}  # msgpack bytes keys
    with pytest.raises(InvalidArgumentError, match="non-empty strings"):
        flatten({1: 2})


def test_an_observation_becomes_one_call_with_a_batch_axis_added() -> None:
    built, batched = call({"state": np.arange(32, dtype=np.float64), "prompt": "pick up the cup"})
    assert batched
    assert (built.client_id, built.client_type, built.priority, built.urgency, built.timeout_ms) == (
        "arm-1",
        "openpi",
        0,
        0.5,
        50.0,
    )
    arrays = decode_tensors(built.inputs, built.payload)
    assert arrays["state"].shape == (1, 32) and arrays["state"].dtype == np.float32  # cast same-kind
    assert arrays["prompt"].shape == () and arrays["prompt"].item() == b"pick up the cup"


def test_values_that_already_have_the_batch_axis_are_left_alone() -> None:
    built, batched = call({"state": np.zeros((4, 32), np.float32)})
    assert not batched
    assert decode_tensors(built.inputs, built.payload)["state"].shape == (4, 32)
    built, batched = call({"anything": np.zeros(3, np.int64)}, None)  # no signature: as sent
    assert not batched and decode_tensors(built.inputs, built.payload)["anything"].dtype == np.int64


@pytest.mark.parametrize(
    ("observation", "message"),
    [
        ({}, "empty"),
        ({"state": None}, "'state' is null"),
        ({"state": [1, None]}, "'state' mixes strings"),
        ({"state": np.zeros(2, np.complex64)}, "'state': dtype complex64"),
    ],
)
def test_bad_observations_are_refused_naming_the_key(observation: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        call(observation)


def test_limits_apply() -> None:
    with pytest.raises(InvalidArgumentError, match="exceed the limit of 64"):
        call({f"k{n}": n for n in range(65)})


def test_options_are_parsed_and_unknown_ones_named() -> None:
    assert parse_options({"priority": "2", "urgency": "0.25", "deadline_ms": "30"}, where="q") == {
        "priority": 2,
        "urgency": 0.25,
        "timeout_ms": 30.0,
    }
    for values, message in [
        ({"priority": -1}, "'priority' must lie in"),
        ({"priority": 1.5}, "'priority' must be an integer"),
        ({"urgency": "x"}, "'urgency' must be a number"),
        ({"deadline_ms": 0}, "'deadline_ms' must be a positive"),
        ({"seed": 1}, "'seed' is not supported"),
    ]:
        with pytest.raises(InvalidArgumentError, match=message):
            parse_options(values, where="option")


def result(arrays: dict[str, np.ndarray]) -> CallResult:
    descriptors, payload = encode_tensors(arrays)
    return CallResult(request_id="r1", model_id="policy", outputs=descriptors, payload=bytes(payload))


def test_actions_come_back_nested_without_the_added_batch_axis() -> None:
    outputs = result({"action/arm": np.ones((1, 7), np.float32), "text": np.array([b"done"], dtype=object)})
    action = action_dict(outputs, unbatch=True)
    assert action["action"]["arm"].shape == (7,)
    assert action["text"] == "done"
    kept = action_dict(outputs, unbatch=False)
    assert kept["action"]["arm"].shape == (1, 7) and kept["text"] == ["done"]


def test_openpi_coding_matches_openpi_clients() -> None:
    # openpi_client/msgpack_numpy.py, as its Packer writes an observation
    def pack_array(obj: object) -> object:
        if isinstance(obj, np.ndarray):
            return {
                b"__ndarray__": True,
                b"data": obj.tobytes(),
                b"dtype": obj.dtype.str,
                b"shape": obj.shape,
            }
        return obj

    state = np.arange(6, dtype=np.float32).reshape(2, 3)
    frame = msgpack.Packer(default=pack_array).pack({"state": state, "prompt": "go"})
    observation = openpi.unpack(frame, max_bytes=1 << 20)
    np.testing.assert_array_equal(observation["state"], state)
    assert observation["prompt"] == "go"
    reply = msgpack.unpackb(openpi.pack({"action": state}))
    assert reply["action"][b"dtype"] == "<f4" and reply["action"][b"shape"] == [2, 3]
    with pytest.raises(InvalidArgumentError, match="not msgpack"):
        openpi.unpack(b"\xc1", max_bytes=10)
    bad = msgpack.packb({"x": {b"__ndarray__": True, b"data": b"12", b"dtype": "<f4", b"shape": [4]}})
    with pytest.raises(InvalidArgumentError, match="malformed"):
        openpi.unpack(bad, max_bytes=1 << 20)
    objects = msgpack.packb(
        {"x": {b"__ndarray__": True, b"data": b"12345678", b"dtype": "|O", b"shape": [1]}}
    )
    with pytest.raises(InvalidArgumentError, match="malformed"):
        openpi.unpack(objects, max_bytes=1 << 20)


def test_gr00t_coding_reads_np_save_without_pickles() -> None:
    state = np.arange(4, dtype=np.float64)
    buffer = io.BytesIO()
    np.save(buffer, state, allow_pickle=False)
    request = msgpack.packb({"observation": {"__ndarray_class__": True, "as_npy": buffer.getvalue()}})
    np.testing.assert_array_equal(gr00t.unpack(request)["observation"], state)
    pickled = io.BytesIO()
    np.save(pickled, np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    attack = msgpack.packb({"observation": {"__ndarray_class__": True, "as_npy": pickled.getvalue()}})
    with pytest.raises(InvalidArgumentError, match=r"not np\.save data"):
        gr00t.unpack(attack)
    answer = gr00t.unpack(gr00t.pack([{"action": state}, {"model": "policy"}]))
    np.testing.assert_array_equal(answer[0]["action"], state)


@pytest.mark.parametrize(
    "array",
    [
        np.ones((1, 32), np.float32),
        np.arange(6, dtype=">i8").reshape(2, 3),
        np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        np.array(3.5),
        np.zeros((0, 4), np.uint8),
        np.array([True, False]),
        np.array(["ab", "c"]),
        np.zeros(3, dtype=[("a", "<f4")]),
        np.arange(10)[::2],
    ],
    ids=lambda a: f"{a.dtype}-{a.shape}",
)
def test_gr00t_arrays_read_and_write_as_np_save_and_np_load_do(array: np.ndarray) -> None:
    written = io.BytesIO()
    np.save(written, array, allow_pickle=False)
    read = gr00t.unpack(msgpack.packb({"__ndarray_class__": True, "as_npy": written.getvalue()}))
    assert read.dtype == array.dtype and read.shape == array.shape and (read == array).all()
    ours = msgpack.unpackb(gr00t.pack(array))["as_npy"]
    back = np.load(io.BytesIO(ours), allow_pickle=False)
    assert back.dtype == array.dtype and back.shape == array.shape and (back == array).all()
    if array.flags.c_contiguous:
        assert ours == written.getvalue()  # byte for byte what np.save writes


def test_a_short_np_save_array_is_refused() -> None:
    written = io.BytesIO()
    np.save(written, np.ones(4, np.float32), allow_pickle=False)
    with pytest.raises(InvalidArgumentError, match="15 data bytes"):
        gr00t.unpack(msgpack.packb({"__ndarray_class__": True, "as_npy": written.getvalue()[:-1]}))
