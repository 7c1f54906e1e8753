"""Integration wiring: a worker on 127.0.0.1:0 with a `tcp://127.0.0.1:*` data port,
a fake scheduler `WorkerSession` endpoint, and a real ZMQ DEALER to talk to the worker."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import zmq
import zmq.asyncio

from loadmaster.common.config import (
    GpuBrokerSettings,
    GpuSpec,
    MetricsSettings,
    ModelPoolSettings,
    ModelsSettings,
    SchedulerSettings,
    Settings,
)
from loadmaster.common.tensors import decode_tensors, encode_tensors
from loadmaster.model_pool.server import ModelPoolServer, build
from loadmaster.v1 import gpu_broker_pb2_grpc, model_pool_pb2, scheduler_pb2, scheduler_pb2_grpc


class FakeScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Records what workers send; `command(...)` pushes a command; `drop()` ends the open streams."""

    def __init__(self) -> None:
        self.messages: list[scheduler_pb2.WorkerSessionRequest] = []
        self.sessions = 0
        self._changed = asyncio.Condition()
        self._queues: list[asyncio.Queue[scheduler_pb2.WorkerSessionResponse | None]] = []

    async def WorkerSession(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        queue: asyncio.Queue[scheduler_pb2.WorkerSessionResponse | None] = asyncio.Queue()
        self._queues.append(queue)
        self.sessions += 1

        async def read() -> None:
            async for message in request_iterator:
                async with self._changed:
                    self.messages.append(message)
                    self._changed.notify_all()

        reader = asyncio.create_task(read())
        try:
            while (command := await queue.get()) is not None:
                yield command
        finally:
            reader.cancel()
            self._queues.remove(queue)

    def command(self, command: scheduler_pb2.WorkerSessionResponse) -> None:
        for queue in self._queues:
            queue.put_nowait(command)

    def drop(self) -> None:
        for queue in self._queues:
            queue.put_nowait(None)

    async def wait_for(
        self,
        predicate: Callable[[scheduler_pb2.WorkerSessionRequest], bool],
        *,
        after: int = 0,
        timeout_s: float = 10.0,
    ) -> scheduler_pb2.WorkerSessionRequest:
        """The first message at index >= `after` that satisfies `predicate`."""

        def find() -> scheduler_pb2.WorkerSessionRequest | None:
            return next((m for m in self.messages[after:] if predicate(m)), None)

        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: find() is not None), timeout_s)
        found = find()
        assert found is not None
        return found


@contextlib.asynccontextmanager
async def fake_scheduler(address: str = "127.0.0.1:0") -> AsyncIterator[tuple[FakeScheduler, str]]:
    servicer = FakeScheduler()
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port(address)
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


def broker_settings(redis_url: str, *, total_mb: int, port: int = 0) -> Settings:
    """The real gpu-broker on 127.0.0.1:`port` over `redis_url`, its own key prefix, one GPU declared."""
    return Settings(
        redis_url=redis_url,
        gpu_broker=GpuBrokerSettings(
            listen=f"127.0.0.1:{port}",
            key_prefix=f"model-pool-test-{uuid.uuid4().hex[:12]}",
            use_nvml=False,
            reserve_mb=0,
            declared={"local": [GpuSpec(index=0, total_mb=total_mb)]},
        ),
        metrics=MetricsSettings(enabled=False),
    )


BrokerAt = Callable[
    ..., contextlib.AbstractAsyncContextManager[tuple[str, gpu_broker_pb2_grpc.GpuBrokerServiceStub]]
]


@pytest.fixture
def real_broker(redis_url: str) -> BrokerAt:
    """`async with real_broker(total_mb=1_000) as (address, stub)`: the real gpu-broker
    (services/gpu-broker) on 127.0.0.1:0 (or `port=`) over the session's Redis, one GPU declared."""
    server_module = pytest.importorskip("loadmaster.gpu_broker.server")

    @contextlib.asynccontextmanager
    async def start(
        *, total_mb: int = 1_000, port: int = 0
    ) -> AsyncIterator[tuple[str, gpu_broker_pb2_grpc.GpuBrokerServiceStub]]:
        settings = broker_settings(redis_url, total_mb=total_mb, port=port)
        server = await server_module.build(settings)
        port = await server.start()
        address = f"127.0.0.1:{port}"
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                yield address, gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel)
        finally:
            await server.stop()

    return start


@pytest.fixture
def scheduler_at() -> Callable[[str], contextlib.AbstractAsyncContextManager[tuple[FakeScheduler, str]]]:
    """`async with scheduler_at("127.0.0.1:PORT") as (fake, address)`: a fake scheduler on a chosen port."""
    return fake_scheduler


@pytest.fixture
async def scheduler() -> AsyncIterator[tuple[FakeScheduler, str]]:
    async with fake_scheduler() as pair:
        yield pair


def worker_settings(
    repository: Path,
    scheduler_address: str,
    *,
    preload: list[str],
    broker_address: str = "127.0.0.1:1",
    **pool: Any,
) -> Settings:
    fields: dict[str, Any] = {
        "address": "127.0.0.1:0",
        "data_bind": "tcp://127.0.0.1:*",
        "worker_id": "worker-test",
        "preload": preload,
        "inference_threads": 1,
        "lease_ttl_s": 6.0,
    }
    fields.update(pool)
    return Settings(
        model_pool=ModelPoolSettings(**fields),
        scheduler=SchedulerSettings(address=scheduler_address),
        gpu_broker=GpuBrokerSettings(address=broker_address),
        metrics=MetricsSettings(enabled=False),
        models=ModelsSettings(repository=repository),
    )


@contextlib.asynccontextmanager
async def running_worker(settings: Settings, **kwargs: Any) -> AsyncIterator[ModelPoolServer]:
    server = await build(settings, **kwargs)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def worker(
    example_repo: Path, leases: Any, scheduler: tuple[FakeScheduler, str]
) -> AsyncIterator[ModelPoolServer]:
    settings = worker_settings(example_repo, scheduler[1], preload=["double", "sleep", "policy"])
    async with running_worker(settings, lease_client=leases) as server:
        yield server


class DataClient:
    """A gateway-like DEALER on the worker's data port."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self._ids = 0

    def request(
        self, model_id: str, arrays: dict[str, np.ndarray] | None = None, **fields: Any
    ) -> tuple[model_pool_pb2.InferRequest, bytes]:
        self._ids += 1
        descriptors, payload = encode_tensors(arrays or {})
        request = model_pool_pb2.InferRequest(
            request_id=fields.pop("request_id", f"r{self._ids}"),
            model_id=model_id,
            inputs=descriptors,
            **fields,
        )
        return request, bytes(payload)

    async def send(self, request: model_pool_pb2.InferRequest, payload: bytes) -> None:
        await self.socket.send_multipart([b"", request.SerializeToString(), payload])

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.socket.send_multipart(frames)

    async def receive(
        self, timeout_s: float = 10.0
    ) -> tuple[model_pool_pb2.InferResponse, dict[str, np.ndarray]]:
        frames = await asyncio.wait_for(self.socket.recv_multipart(), timeout_s)
        assert len(frames) == 3 and frames[0] == b"", frames
        reply = model_pool_pb2.InferResponse.FromString(frames[1])
        return reply, decode_tensors(reply.outputs, frames[2])

    async def call(
        self, model_id: str, arrays: dict[str, np.ndarray] | None = None, **fields: Any
    ) -> tuple[model_pool_pb2.InferResponse, dict[str, np.ndarray]]:
        await self.send(*self.request(model_id, arrays, **fields))
        return await self.receive()

    def close(self) -> None:
        self.socket.close()
        self.context.term()


@pytest.fixture
async def client(worker: ModelPoolServer) -> AsyncIterator[DataClient]:
    data = DataClient(worker.data_endpoint)
    yield data
    data.close()


@pytest.fixture
def make_client() -> Iterator[Callable[[str], DataClient]]:
    clients: list[DataClient] = []

    def make(endpoint: str) -> DataClient:
        clients.append(DataClient(endpoint))
        return clients[-1]

    yield make
    for data in clients:
        data.close()


@contextlib.contextmanager
def broker_on_its_own_thread(redis_url: str, *, total_mb: int) -> Iterator[str]:
    """The real gpu-broker on 127.0.0.1:0, one GPU of `total_mb` on node "local", served from a
    thread with its own event loop: it keeps time while the test's (and worker's) loop is busy."""
    server_module = pytest.importorskip("loadmaster.gpu_broker.server")
    settings = broker_settings(redis_url, total_mb=total_mb)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-broker", daemon=True)
    thread.start()

    async def start() -> tuple[Any, int]:
        server = await server_module.build(settings)
        return server, await server.start()

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture
def broker_thread(redis_url: str) -> Callable[..., contextlib.AbstractContextManager[str]]:
    """`with broker_thread(total_mb=1_000) as address`: see `broker_on_its_own_thread`."""

    def start(*, total_mb: int) -> contextlib.AbstractContextManager[str]:
        return broker_on_its_own_thread(redis_url, total_mb=total_mb)

    return start


StartWorker = Callable[..., contextlib.AbstractAsyncContextManager[ModelPoolServer]]


@pytest.fixture
def start_worker(scheduler: tuple[FakeScheduler, str]) -> StartWorker:
    """`async with start_worker(repo, preload=[...], lease_client=..., **model_pool_fields)`."""

    def start(
        repository: Path, *, preload: list[str], scheduler_address: str | None = None, **kwargs: Any
    ) -> contextlib.AbstractAsyncContextManager[ModelPoolServer]:
        build_kwargs = {k: kwargs.pop(k) for k in ("lease_client", "clock") if k in kwargs}
        settings = worker_settings(repository, scheduler_address or scheduler[1], preload=preload, **kwargs)
        return running_worker(settings, **build_kwargs)

    return start
