"""What the sync and async SDK clients share: observations out, replies in, typed errors."""

from __future__ import annotations

import numpy as np
import pytest

from loadmaster.client._protocol import build_observation, raise_for_error, read_reply, reply_id
from loadmaster.common.errors import ExpiredError, InternalError, NotFoundError, OverflowError_
from loadmaster.common.framing import REQUEST_ID_KEY
from loadmaster.common.tensors import encode_tensors
from loadmaster.v1 import edge_pb2


def test_observation_carries_the_request_id_and_options() -> None:
    observation, payload = build_observation(
        client_id="c1",
        client_type="robot",
        model_id="policy",
        request_id="c1-7",
        urgency=0.5,
        priority=0,
        steps_remaining=3,
        timeout_ms=25.0,
        tensors={"x": np.arange(3, dtype=np.float32)},
    )
    assert observation.metadata[REQUEST_ID_KEY] == "c1-7"
    assert observation.metadata["timeout_ms"] == "25.0"
    assert observation.client.id == "c1" and observation.client.type == "robot"
    assert observation.priority == 0 and observation.steps_remaining == 3
    assert observation.tensors[0].key == "x" and len(payload) == 12
    plain, _ = build_observation(
        client_id="c",
        client_type="",
        model_id="m",
        request_id="r",
        urgency=0.0,
        priority=1,
        steps_remaining=None,
        timeout_ms=None,
        tensors={},
    )
    assert not plain.HasField("steps_remaining") and "timeout_ms" not in plain.metadata


@pytest.mark.parametrize(
    ("code", "error"),
    [
        ("not_found", NotFoundError),
        ("expired", ExpiredError),
        ("overflow", OverflowError_),
        ("bogus", InternalError),
    ],
)
def test_error_codes_raise_typed_errors(code: str, error: type[Exception]) -> None:
    with pytest.raises(error, match="the message"):
        raise_for_error({"error_code": code, "error": "the message"})
    raise_for_error({"request_id": "r"})  # no error: nothing raised


def test_read_reply_returns_arrays_and_metadata() -> None:
    descriptors, payload = encode_tensors({"y": np.array([1, 2], dtype=np.int64)})
    response = edge_pb2.ModelResponse(
        response_id="g-1", model_id="m", tensors=descriptors, inference_latency_ms=1.5
    )
    response.metadata[REQUEST_ID_KEY] = "c-3"
    assert reply_id(response) == "c-3"
    result = read_reply(response, bytes(payload))
    np.testing.assert_array_equal(result["y"], [1, 2])
    assert (
        result["request_id"] == "c-3" and result["model_id"] == "m" and result["inference_latency_ms"] == 1.5
    )
    assert reply_id(edge_pb2.ModelResponse(response_id="g-2")) == "g-2"
    failed = edge_pb2.ModelResponse(model_id="m")
    failed.metadata["error_code"] = "not_found"
    failed.metadata["error"] = "model 'm' is unknown"
    with pytest.raises(NotFoundError, match="unknown"):
        read_reply(failed, b"")
