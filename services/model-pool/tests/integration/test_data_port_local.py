"""The data port's local link (loadmaster.common.local_link): a gateway on the worker's host
reaches it over a Unix socket, with the same messages as on ZMQ, beside ZMQ gateways."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadmaster.common import local_link
from loadmaster.common.tensors import decode_tensors
from loadmaster.model_pool.server import ModelPoolServer
from loadmaster.v1 import errors_pb2, model_pool_pb2

from .conftest import DataClient, running_worker, worker_settings

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="abstract Unix sockets are Linux's")

OK = errors_pb2.ERROR_CODE_UNSPECIFIED


class LocalDataClient(DataClient):
    """What the gateway's WorkerLinks does for a worker on its host: the data port's messages
    over its local link."""

    def __init__(self, endpoint: str) -> None:
        name = local_link.reachable_locally(endpoint)
        assert name is not None
        sock = local_link.connect(name)
        assert sock is not None, "the data port does not listen on its local link"
        self.replies: asyncio.Queue[list[bytes]] = asyncio.Queue()
        self.link = local_link.FrameSocket(
            sock, lambda frames: self.replies.put_nowait([bytes(f) for f in frames]), print, name="test"
        )
        self._ids = 0

    async def send(self, request: model_pool_pb2.InferRequest, payload: bytes) -> None:
        self.link.send([b"", request.SerializeToString(), payload])

    async def send_raw(self, frames: list[bytes]) -> None:
        self.link.send(frames)

    async def receive(self, timeout_s: float = 10.0) -> tuple[model_pool_pb2.InferResponse, dict[str, Any]]:
        frames = await asyncio.wait_for(self.replies.get(), timeout_s)
        assert len(frames) == 3 and frames[0] == b"", frames
        reply = model_pool_pb2.InferResponse.FromString(frames[1])
        return reply, decode_tensors(reply.outputs, frames[2])

    def close(self) -> None:
        self.link.close()


async def test_a_local_gateway_and_a_zmq_gateway_each_get_their_own_replies(worker: ModelPoolServer) -> None:
    local, remote = LocalDataClient(worker.data_endpoint), DataClient(worker.data_endpoint)
    try:
        x = np.arange(6, dtype=np.float32)
        await local.send(*local.request("double", {"x": x}, request_id="local-1"))
        await remote.send(*remote.request("double", {"x": x + 1}, request_id="zmq-1"))
        reply, outputs = await local.receive()
        assert (reply.request_id, reply.error_code) == ("local-1", OK), reply.error_message
        np.testing.assert_array_equal(outputs["x"], x * 2)
        reply, outputs = await remote.receive()
        assert reply.request_id == "zmq-1"
        np.testing.assert_array_equal(outputs["x"], (x + 1) * 2)
    finally:
        local.close()
        remote.close()


async def test_a_burst_on_the_local_link_is_answered_whole(worker: ModelPoolServer) -> None:
    local = LocalDataClient(worker.data_endpoint)
    try:
        for index in range(300):
            await local.send(
                *local.request("double", {"x": np.full(3, index, np.float32)}, request_id=f"b{index}")
            )
        answered = {}
        for _ in range(300):
            reply, outputs = await local.receive()
            assert reply.error_code == OK, reply.error_message
            answered[reply.request_id] = outputs["x"].tolist()
        assert answered == {f"b{index}": [2.0 * index] * 3 for index in range(300)}
    finally:
        local.close()


async def test_malformed_local_messages_are_answered_and_the_link_keeps_serving(
    worker: ModelPoolServer,
) -> None:
    local = LocalDataClient(worker.data_endpoint)
    try:
        await local.send_raw([b"", b"\xff\xff not a protobuf", b""])
        reply, _ = await local.receive()
        assert reply.error_code == errors_pb2.ERROR_CODE_INVALID_ARGUMENT
        assert "not an InferRequest" in reply.error_message
        await local.send_raw([b"a", b"b", b"c", b"d"])
        reply, _ = await local.receive()
        assert reply.error_code == errors_pb2.ERROR_CODE_INVALID_ARGUMENT
        assert "4 frames" in reply.error_message
        reply, outputs = await local.call("double", {"x": np.ones(2, np.float32)})
        assert reply.error_code == OK and outputs["x"].tolist() == [2.0, 2.0]
    finally:
        local.close()


async def test_a_local_gateway_that_leaves_mid_request_costs_the_others_nothing(
    worker: ModelPoolServer,
) -> None:
    leaving = LocalDataClient(worker.data_endpoint)
    await leaving.send(*leaving.request("sleep", {"x": np.ones(1, np.float32)}))
    leaving.close()  # its reply has nowhere to go: dropped, as a ROUTER drops it
    staying = LocalDataClient(worker.data_endpoint)
    try:
        reply, outputs = await staying.call("double", {"x": np.ones(2, np.float32)})
        assert reply.error_code == OK and outputs["x"].tolist() == [2.0, 2.0]
    finally:
        staying.close()


async def test_the_local_link_can_be_turned_off(example_repo: Path, leases: Any, scheduler: Any) -> None:
    settings = worker_settings(example_repo, scheduler[1], preload=["double"], local_link=False)
    async with running_worker(settings, lease_client=leases) as server:
        name = local_link.reachable_locally(server.data_endpoint)
        assert name is not None and local_link.connect(name) is None
