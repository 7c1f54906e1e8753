"""An in-process scheduler on 127.0.0.1:0 and thin gRPC clients that speak its streams."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc
import pytest

from loadmaster.common.config import load_settings
from loadmaster.common.grpc_client import aio_channel
from loadmaster.scheduler.server import build
from loadmaster.v1 import model_pool_pb2, scheduler_pb2, scheduler_pb2_grpc

READY = model_pool_pb2.MODEL_STATE_READY
LOADING = model_pool_pb2.MODEL_STATE_LOADING
IDLE = model_pool_pb2.MODEL_STATE_IDLE

STEP_TIMEOUT_S = 5.0


class GatewayClient:
    """One `Session` stream, as a gateway would hold it."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerServiceStub, gateway_id: str) -> None:
        self.call = stub.Session()
        self._gateway_id = gateway_id
        self.grants: dict[str, scheduler_pb2.Grant] = {}
        self.rejects: dict[str, scheduler_pb2.Reject] = {}

    async def open(self) -> GatewayClient:
        await self.call.write(
            scheduler_pb2.SessionRequest(hello=scheduler_pb2.SessionHello(gateway_id=self._gateway_id))
        )
        return self

    async def enqueue(self, request_id: str, model_id: str, **fields: Any) -> None:
        info = scheduler_pb2.RequestInfo(request_id=request_id, model_id=model_id, **fields)
        await self.call.write(scheduler_pb2.SessionRequest(enqueue=[info]))

    async def complete(self, grant: scheduler_pb2.Grant, **fields: Any) -> None:
        done = scheduler_pb2.Complete(request_id=grant.request_id, worker_id=grant.worker_id, **fields)
        await self.call.write(scheduler_pb2.SessionRequest(complete=[done]))

    async def receive(self) -> scheduler_pb2.SessionResponse:
        response = await asyncio.wait_for(self.call.read(), STEP_TIMEOUT_S)
        assert response is not grpc.aio.EOF, "the scheduler ended the session"
        for grant in response.grants:
            self.grants[grant.request_id] = grant
        for reject in response.rejects:
            self.rejects[reject.request_id] = reject
        return response

    async def outcome(self, request_id: str) -> scheduler_pb2.Grant | scheduler_pb2.Reject:
        """The next grant or reject for `request_id` (earlier answers for it are forgotten)."""
        self.grants.pop(request_id, None)
        self.rejects.pop(request_id, None)
        while request_id not in self.grants and request_id not in self.rejects:
            await self.receive()
        return self.grants.get(request_id) or self.rejects[request_id]

    async def close(self) -> None:
        self.call.cancel()


class WorkerClient:
    """One `WorkerSession` stream, as a model-pool worker would hold it."""

    def __init__(
        self, stub: scheduler_pb2_grpc.SchedulerServiceStub, worker_id: str, repository: Iterable[str]
    ) -> None:
        self.call = stub.WorkerSession()
        self.worker_id = worker_id
        self.repository = list(repository)

    async def open(self) -> WorkerClient:
        hello = scheduler_pb2.WorkerHello(
            worker_id=self.worker_id, data_endpoint=f"tcp://{self.worker_id}:5556", repository=self.repository
        )
        await self.call.write(scheduler_pb2.WorkerSessionRequest(hello=hello))
        return self

    async def report(self, states: dict[str, int], *, generation: int = 1, error: str = "") -> None:
        models = [
            model_pool_pb2.ModelSlotStatus(
                model_id=m, state=s, generation=generation, error=error if s == IDLE else ""
            )
            for m, s in states.items()
        ]
        await self.call.write(
            scheduler_pb2.WorkerSessionRequest(report=scheduler_pb2.WorkerReport(models=models))
        )

    async def command(self) -> scheduler_pb2.WorkerSessionResponse:
        command = await asyncio.wait_for(self.call.read(), STEP_TIMEOUT_S)
        assert command is not grpc.aio.EOF, "the scheduler ended the worker session"
        return command

    async def close(self) -> None:
        self.call.cancel()


async def eventually(check: Callable[[], Awaitable[bool]], *, timeout_s: float = STEP_TIMEOUT_S) -> None:
    """Wait until `check()` holds (the scheduler applies stream messages asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


class SchedulerHarness:
    def __init__(self, stub: scheduler_pb2_grpc.SchedulerServiceStub, address: str = "") -> None:
        self.stub = stub
        self.address = address
        self._clients: list[GatewayClient | WorkerClient] = []

    async def gateway(self, gateway_id: str = "gw") -> GatewayClient:
        client = await GatewayClient(self.stub, gateway_id).open()
        self._clients.append(client)
        return client

    async def worker(
        self, worker_id: str, repository: Iterable[str], *, ready: Iterable[str] = ()
    ) -> WorkerClient:
        client = await WorkerClient(self.stub, worker_id, repository).open()
        self._clients.append(client)
        ready = list(ready)
        if ready:
            await client.report({m: READY for m in ready})
            await self.wait_ready(worker_id, ready)
        else:
            await eventually(lambda: self._has_worker(worker_id))
        return client

    @staticmethod
    async def eventually(check: Callable[[], Awaitable[bool]]) -> None:
        await eventually(check)

    async def workers(self) -> dict[str, scheduler_pb2.WorkerInfo]:
        response = await self.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())
        return {w.worker_id: w for w in response.workers}

    async def wait_ready(self, worker_id: str, models: Iterable[str]) -> None:
        wanted = set(models)

        async def ready() -> bool:
            info = (await self.workers()).get(worker_id)
            return info is not None and wanted <= {m.model_id for m in info.models if m.state == READY}

        await eventually(ready)

    async def wait_gone(self, worker_id: str) -> None:
        async def gone() -> bool:
            return worker_id not in await self.workers()

        await eventually(gone)

    async def _has_worker(self, worker_id: str) -> bool:
        return worker_id in await self.workers()

    async def close(self) -> None:
        for client in self._clients:
            await client.close()


@pytest.fixture
async def scheduler() -> AsyncIterator[SchedulerHarness]:
    settings = load_settings(
        None,
        scheduler={"address": "127.0.0.1:0", "request_ttl_ms": 2000.0, "max_retries": 1},
        metrics={"enabled": False},
        models={"defaults": {"max_inflight": 1}},
    )
    server = build(settings)
    port = await server.start()
    channel = aio_channel(f"127.0.0.1:{port}")
    harness = SchedulerHarness(scheduler_pb2_grpc.SchedulerServiceStub(channel), f"127.0.0.1:{port}")
    try:
        yield harness
    finally:
        await harness.close()
        await channel.close()
        await server.stop()
