"""gRPC's own retry policy as `retry_options` configures it, against a real in-process server
on 127.0.0.1:0: an idempotent call is sent again while the server answers UNAVAILABLE, with the
same request; a call left out of the policy is sent once."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from loadmaster.common.grpc_client import aio_channel
from loadmaster.common.retry import retry_options
from loadmaster.v1 import gpu_broker_pb2 as pb
from loadmaster.v1 import gpu_broker_pb2_grpc


class _Flaky(gpu_broker_pb2_grpc.GpuBrokerServiceServicer):
    """Answers UNAVAILABLE `failures` times per method, then grants; records what it got."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.acquires: list[str] = []  # client_request_id of each attempt
        self.releases = 0

    async def Acquire(  # noqa: N802
        self, request: pb.AcquireRequest, context: grpc.aio.ServicerContext
    ) -> pb.AcquireResponse:
        self.acquires.append(request.client_request_id)
        if len(self.acquires) <= self.failures:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        return pb.AcquireResponse(lease=pb.Lease(lease_id="l-1", fencing_token=7))

    async def Release(  # noqa: N802
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        self.releases += 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        raise AssertionError("abort raises")


@pytest.fixture()
async def flaky() -> AsyncIterator[tuple[_Flaky, str]]:
    servicer = _Flaky(failures=2)
    server = grpc.aio.server()
    gpu_broker_pb2_grpc.add_GpuBrokerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)


async def test_an_idempotent_call_is_sent_again_while_unavailable(flaky: tuple[_Flaky, str]) -> None:
    servicer, address = flaky
    async with aio_channel(address, options=retry_options(max_attempts=3)) as channel:
        stub = gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel)
        reply = await stub.Acquire(pb.AcquireRequest(client_request_id="r-1", mb=64), timeout=10)
    assert reply.lease.lease_id == "l-1"
    assert servicer.acquires == ["r-1", "r-1", "r-1"]  # the same request id each time


async def test_attempts_are_bounded(flaky: tuple[_Flaky, str]) -> None:
    servicer, address = flaky
    async with aio_channel(address, options=retry_options(max_attempts=2)) as channel:
        stub = gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Acquire(pb.AcquireRequest(client_request_id="r-2", mb=64), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert servicer.acquires == ["r-2", "r-2"]


async def test_a_call_outside_the_policy_is_sent_once(flaky: tuple[_Flaky, str]) -> None:
    servicer, address = flaky
    async with aio_channel(address, options=retry_options()) as channel:
        stub = gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Release(pb.ReleaseRequest(lease_id="l-1", fencing_token=7), timeout=10)
    assert servicer.releases == 1
