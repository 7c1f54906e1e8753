"""KServe v2 translation: inputs -> one call, outputs back; HTTP bodies; parameters."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.common.gateway_config import LimitsSettings
from loadmaster.gateway.calls import CallResult
from loadmaster.gateway.frontends.http_codec import encode_response, parse_infer
from loadmaster.gateway.kserve_calls import (
    KServeInput,
    build_call,
    check_parameters,
    outputs_of,
    parse_priority,
    parse_timeout_ms,
)
from loadmaster.v1 import tensor_pb2

LIMITS = LimitsSettings()


def _call(inputs: list[KServeInput], limits: LimitsSettings = LIMITS):  # type: ignore[no-untyped-def]
    return build_call(
        inputs, model_id="double", request_id="r1", client_id="c", priority=1, timeout_ms=0, limits=limits
    )


def test_inputs_become_descriptors_into_one_payload() -> None:
    a = np.arange(3, dtype=np.float32)
    b = np.array([[1, 2]], dtype=np.int64)
    call = _call(
        [KServeInput("a", "FP32", (3,), a.tobytes()), KServeInput("b", "INT64", (1, 2), b.tobytes())]
    )
    assert [d.key for d in call.inputs] == ["a", "b"]
    assert call.inputs[1].byte_offset == a.nbytes and call.inputs[1].byte_length == b.nbytes
    assert call.inputs[1].dtype == tensor_pb2.DTYPE_INT64
    assert bytes(call.payload) == a.tobytes() + b.tobytes()
    assert call.client_type == "kserve"


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([KServeInput("x", "FP32", (3,), b"\0" * 8)], "tensor 'x': byte_length 8 != 12"),
        ([KServeInput("x", "COMPLEX64", (1,), b"")], "tensor 'x': datatype 'COMPLEX64'"),
        ([KServeInput("x", "FP32", (1,), b"\0" * 4)] * 2, "tensor 'x' appears more than once"),
        ([KServeInput("x", "FP32", (1,) * 9, b"\0" * 4)], "tensor 'x': 9 dimensions exceed"),
        ([KServeInput("x", "FP32", (-1,), b"")], "negative dimension"),
    ],
)
def test_bad_inputs_name_the_tensor(inputs: list[KServeInput], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _call(inputs)


def test_limits_on_tensors_and_payload() -> None:
    small = LimitsSettings(max_tensors=1, max_payload_bytes=8)
    with pytest.raises(InvalidArgumentError, match="2 tensors exceed the limit of 1"):
        _call([KServeInput("a", "UINT8", (1,), b"\0"), KServeInput("b", "UINT8", (1,), b"\0")], small)
    with pytest.raises(InvalidArgumentError, match="exceeds the limit of 8"):
        _call([KServeInput("a", "UINT8", (9,), b"\0" * 9)], small)


def test_parameters() -> None:
    assert parse_priority(None) == 1  # Loadmaster's default
    assert parse_priority(0) == 1  # v2/Triton: 0 = the default
    assert parse_priority(1) == 0  # v2/Triton: 1 = the highest
    assert parse_priority(5) == 4
    for bad in (-1, 1.5, "high", True, 2**32 + 1):
        with pytest.raises(InvalidArgumentError, match="priority"):
            parse_priority(bad)
    assert parse_timeout_ms(None) == 0.0
    assert parse_timeout_ms(250_000) == 250.0  # microseconds -> ms
    assert parse_timeout_ms(None, deadline_s=0.5) == 500.0
    assert parse_timeout_ms(1_000_000, deadline_s=0.2) == 200.0  # the tighter one wins
    for bad in (-5, float("nan"), "soon"):
        with pytest.raises(InvalidArgumentError, match="timeout"):
            parse_timeout_ms(bad)


def test_parameters_size_limit() -> None:
    limits = LimitsSettings(max_metadata_bytes=16)
    check_parameters({"priority": 1, "id": 12345}, limits)  # 8 + 1 + 2 + 5 = 16 bytes: at the limit
    with pytest.raises(InvalidArgumentError, match="parameters of 26 bytes exceed the limit of 16"):
        check_parameters({"note": "x" * 22}, limits)


def test_outputs_slice_the_reply_payload() -> None:
    x = np.arange(4, dtype=np.float16)
    y = np.array([True, False])
    payload = x.tobytes() + y.tobytes()
    descriptors = [
        tensor_pb2.Tensor(key="x", dtype=tensor_pb2.DTYPE_FLOAT16, shape=[4], byte_offset=0, byte_length=8),
        tensor_pb2.Tensor(key="y", dtype=tensor_pb2.DTYPE_BOOL, shape=[2], byte_offset=8, byte_length=2),
    ]
    result = CallResult(request_id="r", model_id="m", outputs=descriptors, payload=payload)
    outputs = outputs_of(result)
    assert [(o.name, o.datatype, o.shape) for o in outputs] == [("x", "FP16", (4,)), ("y", "BOOL", (2,))]
    assert bytes(outputs[0].data) == x.tobytes()
    assert [o.name for o in outputs_of(result, ["y"])] == ["y"]
    with pytest.raises(InvalidArgumentError, match="'z'"):
        outputs_of(result, ["z"])


def test_http_json_and_binary_inputs() -> None:
    header = {
        "id": "q",
        "parameters": {"binary_data_output": True, "priority": 0},
        "inputs": [
            {"name": "a", "shape": [2], "datatype": "INT64", "data": [[1], [2]]},
            {"name": "b", "shape": [3], "datatype": "UINT8", "parameters": {"binary_data_size": 3}},
        ],
        "outputs": [{"name": "a", "parameters": {"binary_data": False}}, {"name": "b"}],
    }
    head = json.dumps(header).encode()
    parsed = parse_infer(head + b"\x01\x02\x03", str(len(head)))
    assert parsed.id == "q" and parsed.parameters["priority"] == 0
    assert bytes(parsed.inputs[0].data) == np.array([1, 2], np.int64).tobytes()
    assert bytes(parsed.inputs[1].data) == b"\x01\x02\x03"
    assert parsed.outputs == {"a": False, "b": True}


@pytest.mark.parametrize(
    ("body", "length", "message"),
    [
        (b"{", None, "not JSON"),
        (b"[]", None, "request body"),
        (b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32"}]}', None, "tensor 'x': no data"),
        (
            b'{"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1]}]}',
            None,
            "tensor 'x': 1 elements",
        ),
        (
            b'{"inputs": [{"name": "x", "shape": [1], "datatype": "UINT8", "data": [300]}]}',
            None,
            "tensor 'x'",
        ),
        (b'{"inputs": []}', "99", "outside"),
        (b'{"inputs": []}xx', "14", "belong to no input"),
        (
            b'{"inputs": [{"name": "x", "shape": [4], "datatype": "UINT8", "parameters": {"binary_data_size": 4}}]}',
            None,
            "runs past",
        ),
        (b"[" * 100_000, None, "not JSON"),
    ],
)
def test_http_bad_bodies(body: bytes, length: str | None, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        parse_infer(body, length)


def test_http_response_mixes_json_and_binary() -> None:
    x = np.array([1.5, 2.5], dtype=np.float32)
    descriptors = [
        tensor_pb2.Tensor(key="x", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[2], byte_offset=0, byte_length=8),
        tensor_pb2.Tensor(key="y", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[2], byte_offset=0, byte_length=8),
    ]
    outputs = outputs_of(CallResult(request_id="r", model_id="m", outputs=descriptors, payload=x.tobytes()))
    body, length = encode_response(
        model_name="m", request_id="r", outputs=outputs, binary={"x": False}, binary_default=True
    )
    assert length is not None
    header = json.loads(body[:length])
    assert header["id"] == "r"
    assert header["outputs"][0]["data"] == [1.5, 2.5]
    assert header["outputs"][1]["parameters"] == {"binary_data_size": 8}
    assert body[length:] == x.tobytes()
    body, length = encode_response(
        model_name="m", request_id="", outputs=outputs, binary={}, binary_default=False
    )
    assert length is None and "id" not in json.loads(body)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_json_outputs_never_carry_nan_or_infinity(value: float) -> None:
    x = np.array([1.0, value], dtype=np.float32)
    descriptors = [tensor_pb2.Tensor(key="y", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[2], byte_length=8)]
    outputs = outputs_of(CallResult(request_id="r", model_id="m", outputs=descriptors, payload=x.tobytes()))
    with pytest.raises(InvalidArgumentError, match=r"output 'y' holds NaN or Infinity.*binary data"):
        encode_response(model_name="m", request_id="r", outputs=outputs, binary={}, binary_default=False)
    body, length = encode_response(
        model_name="m", request_id="r", outputs=outputs, binary={}, binary_default=True
    )
    assert length is not None and body[length:] == x.tobytes()  # binary data carries them bit for bit


def test_json_bodies_over_their_own_limit_are_refused_before_parsing() -> None:
    body = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}).encode()
    with pytest.raises(
        InvalidArgumentError, match=f"JSON request body of {len(body)} bytes exceeds the limit of 10"
    ):
        parse_infer(body, None, LimitsSettings(max_json_bytes=10))
    assert parse_infer(body, None, LimitsSettings(max_json_bytes=len(body))).inputs[0].name == "x"


def test_json_bytes_elements_are_limited() -> None:
    body = json.dumps({"inputs": [{"name": "s", "shape": [3], "datatype": "BYTES", "data": ["a", "b", "c"]}]})
    with pytest.raises(InvalidArgumentError, match="tensor 's': 3 BYTES elements exceed the limit of 2"):
        parse_infer(body.encode(), None, LimitsSettings(max_bytes_elements=2))
