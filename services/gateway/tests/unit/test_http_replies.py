"""HTTP infer replies: binary data goes out as views of the worker's reply, large data streamed
in chunks (a 64 MiB reply used to be copied whole three times on the event loop, then once
more by h11 and again into the transport's buffer)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from loadmaster.gateway.calls import CallResult
from loadmaster.gateway.frontends import http
from loadmaster.gateway.frontends.http_codec import encode_response_parts, json_encoding_bytes
from loadmaster.gateway.kserve_calls import outputs_of
from loadmaster.v1 import tensor_pb2


def _outputs(payload: np.ndarray) -> list:  # type: ignore[type-arg]
    half = payload.nbytes // 2
    descriptors = [
        tensor_pb2.Tensor(
            key="a", dtype=tensor_pb2.DTYPE_UINT8, shape=[half], byte_offset=0, byte_length=half
        ),
        tensor_pb2.Tensor(
            key="b", dtype=tensor_pb2.DTYPE_UINT8, shape=[half], byte_offset=half, byte_length=half
        ),
    ]
    return outputs_of(CallResult(request_id="r", model_id="m", outputs=descriptors, payload=payload))


def test_binary_outputs_are_views_of_the_reply_never_copies() -> None:
    payload = np.arange(4 << 10, dtype=np.uint8)
    outputs = _outputs(payload)
    head, blobs = encode_response_parts(
        model_name="m", request_id="r", outputs=outputs, binary={"b": False}, binary_default=True
    )
    assert len(blobs) == 1 and np.shares_memory(np.frombuffer(blobs[0], np.uint8), payload)
    assert bytes(blobs[0]) == payload[: 2 << 10].tobytes()
    header = json.loads(head)
    assert header["outputs"][0]["parameters"] == {"binary_data_size": 2 << 10}
    assert header["outputs"][1]["data"] == payload[2 << 10 :].tolist()
    # What encoding costs grows with: only the outputs sent as JSON values.
    assert json_encoding_bytes(outputs, {"b": False}, True) == 2 << 10
    assert json_encoding_bytes(outputs, {}, True) == 0
    assert json_encoding_bytes(outputs, {}, False) == 4 << 10


@pytest.mark.parametrize("size", [1 << 10, (3 << 20) + 5])
def test_infer_responses_carry_the_header_then_the_data_whole(size: int) -> None:
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    head = b'{"outputs":[]}'

    async def reply(request: Request) -> Response:
        return http._infer_response(head, [memoryview(data)])

    response = http._infer_response(head, [memoryview(data)])
    large = size > http.STREAM_REPLY_BYTES
    assert isinstance(response, StreamingResponse) is large  # large data is streamed in chunks
    with TestClient(Starlette(routes=[Route("/", reply)])) as client:
        got = client.get("/")
    assert got.status_code == 200
    assert got.headers["inference-header-content-length"] == str(len(head))
    assert got.headers["content-length"] == str(len(head) + size)
    assert got.headers["content-type"] == "application/octet-stream"
    assert got.content == head + data.tobytes()


def test_an_infer_response_without_binary_data_is_json() -> None:
    response = http._infer_response(b'{"outputs":[]}', [])
    assert response.body == b'{"outputs":[]}' and response.media_type == "application/json"
