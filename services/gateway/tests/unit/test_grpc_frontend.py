"""The KServe gRPC servicer's input path, on its own: large messages split without copying their
data, and a stream's bounded in-flight requests (a dispatcher double that never answers)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from loadmaster.common.config import LimitsSettings
from loadmaster.gateway.auth import Authenticator
from loadmaster.gateway.calls import InferenceCall, ResultCallback
from loadmaster.gateway.frontends.grpc import KServeGrpcServicer
from loadmaster.gateway.frontends.grpc_wire import split_infer_request
from loadmaster.v1 import inference_pb2


def _request(*contents: bytes) -> inference_pb2.ModelInferRequest:
    request = inference_pb2.ModelInferRequest(model_name="double", id="r7")
    request.parameters["priority"].int64_param = 2
    for index, data in enumerate(contents):
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = f"x{index}", "UINT8"
        tensor.shape.append(len(data))
    request.raw_input_contents.extend(contents)
    request.outputs.add().name = "y"
    return request


def test_a_split_request_equals_protobufs_parse_with_its_data_as_views() -> None:
    contents = (b"a" * 3000, b"", b"\x07" * 200_000)
    data = _request(*contents).SerializeToString()
    split = split_infer_request(data)
    assert split is not None
    assert [bytes(view) for view in split.raw_input_contents] == list(contents)
    assert all(view.obj is data for view in split.raw_input_contents)  # views, not copies
    whole = inference_pb2.ModelInferRequest.FromString(data)
    del whole.raw_input_contents[:]
    assert split.message == whole


def test_a_top_level_that_cannot_be_walked_is_left_to_protobuf() -> None:
    assert split_infer_request(b"\x3a\xff\xff\xff\xff\x0f") is None  # a length far past the end
    assert split_infer_request(b"\x0b") is None  # wire type 3 (groups)


class _SilentDispatcher:
    """Takes every call and never answers it."""

    def __init__(self) -> None:
        self.calls: list[InferenceCall] = []

    def submit(self, call: InferenceCall, on_result: ResultCallback) -> None:
        self.calls.append(call)

    def cancel(self, request_id: str) -> None:
        pass


class _Context:
    def invocation_metadata(self) -> tuple[()]:
        return ()


async def test_a_stream_reads_no_further_than_its_in_flight_bound() -> None:
    dispatcher = _SilentDispatcher()
    servicer = KServeGrpcServicer(
        dispatcher,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        Authenticator([]),
        LimitsSettings(max_stream_inflight=4),
        gateway_id="g",
    )
    pulled = 0

    async def requests() -> AsyncIterator[Any]:
        nonlocal pulled
        for _ in range(50):
            pulled += 1
            yield _request(b"\x01")

    replies = servicer.ModelStreamInfer(requests(), _Context())  # type: ignore[arg-type]
    reader = asyncio.ensure_future(replies.__anext__())
    for _ in range(100):  # let the stream read all it will
        await asyncio.sleep(0)
    assert len(dispatcher.calls) == 4
    assert pulled <= 5  # the four in flight, and the one waiting for a slot
    reader.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reader
