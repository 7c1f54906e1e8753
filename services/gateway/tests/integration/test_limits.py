"""Configured limits hold on every front end: 400 / INVALID_ARGUMENT naming the problem."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from loadmaster.client import Connection
from loadmaster.common.errors import InvalidArgumentError

LIMITS = {
    "limits": {
        "max_payload_bytes": 1024,
        "max_tensors": 2,
        "max_dims": 3,
        "max_metadata_bytes": 64,
        "max_envelope_bytes": 4096,
        "max_json_bytes": 4096,
    }
}


@pytest.fixture(scope="module")
def gateway(start_gateway: Callable[..., Any]) -> Any:
    return start_gateway(LIMITS)


def _tensor(name: str, shape: list[int]) -> dict[str, Any]:
    count = int(np.prod(shape))
    return {"name": name, "shape": shape, "datatype": "FP32", "data": [0.0] * count}


@pytest.mark.parametrize(
    ("inputs", "expected"),
    [
        ([_tensor("a", [1]), _tensor("b", [1]), _tensor("c", [1])], "3 tensors exceed the limit of 2"),
        ([_tensor("deep", [1, 1, 1, 1])], "tensor 'deep': 4 dimensions exceed the limit of 3"),
        ([_tensor("big", [300])], "exceeds the limit of 1024"),
        ([{"name": "x", "shape": [2], "datatype": "FP32", "data": [1.0]}], "tensor 'x'"),
    ],
)
def test_http_limits(gateway: Any, inputs: list[dict[str, Any]], expected: str) -> None:
    reply = httpx.post(f"{gateway.http_url}/v2/models/double/infer", json={"inputs": inputs}, timeout=10)
    assert reply.status_code == 400
    assert expected in reply.json()["error"]


def test_http_body_limit_is_checked_before_reading(gateway: Any) -> None:
    body = b"x" * 10_000
    reply = httpx.post(f"{gateway.http_url}/v2/models/double/infer", content=body, timeout=10)
    assert reply.status_code == 400 and "exceeds the limit" in reply.json()["error"]


def test_grpc_limits(gateway: Any) -> None:
    client = triton_grpc.InferenceServerClient(gateway.grpc_address)
    try:
        tensors = []
        for name in ("a", "b", "c"):
            tensor = triton_grpc.InferInput(name, [1], "FP32")
            tensor.set_data_from_numpy(np.zeros(1, np.float32))
            tensors.append(tensor)
        with pytest.raises(InferenceServerException) as raised:
            client.infer("double", tensors)
        assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "3 tensors exceed the limit of 2" in raised.value.message()
        big = triton_grpc.InferInput("big", [512], "FP32")
        big.set_data_from_numpy(np.zeros(512, np.float32))
        with pytest.raises(InferenceServerException) as raised:
            client.infer("double", [big])
        assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "exceeds the limit of 1024" in raised.value.message()
    finally:
        client.close()


def test_edge_limits(gateway: Any) -> None:
    with Connection(gateway.edge) as conn:
        model = conn.model("double")
        with pytest.raises(InvalidArgumentError, match="exceed the limit of 2"):
            model.infer(a=np.zeros(1, np.float32), b=np.zeros(1, np.float32), c=np.zeros(1, np.float32))
        with pytest.raises(InvalidArgumentError, match="exceeds the limit of 1024"):
            model.infer(x=np.zeros(512, np.float32))
        with pytest.raises(InvalidArgumentError, match="4 dimensions exceed the limit of 3"):
            model.infer(x=np.zeros((1, 1, 1, 1), np.float32))
    assert gateway.process.poll() is None
