"""Issue 25, Found 5: a process on the same host without credentials is refused, and the
refusal is logged naming it.

The real scheduler, gpu-broker (real Redis) and model-pool worker run in this process on
127.0.0.1 with a suite secret and an admin token (`internal_auth.setup`); the worker registers
with the scheduler, takes its lease from the broker and loads `double`. The intruder speaks
plain gRPC and ZMQ without credentials, exactly as it could before this issue, and each of
its moves is checked both ways: refused, and nothing changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import zmq
import zmq.asyncio

from loadmaster.common import internal_auth
from loadmaster.common.config import (
    GpuBrokerSettings,
    GpuSpec,
    MetricsSettings,
    ModelPoolSettings,
    ModelsSettings,
    SchedulerSettings,
    Settings,
)
from loadmaster.common.credentials import Credentials, Identity
from loadmaster.common.errors import edge_code_name
from loadmaster.common.grpc_client import aio_channel
from loadmaster.common.grpc_server import GrpcServer
from loadmaster.common.tensors import encode_tensors
from loadmaster.v1 import (
    gpu_broker_pb2,
    gpu_broker_pb2_grpc,
    model_pool_pb2,
    model_pool_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

gpu_broker_server = pytest.importorskip("loadmaster.gpu_broker.server")
scheduler_server = pytest.importorskip("loadmaster.scheduler.server")
model_pool_server = pytest.importorskip("loadmaster.model_pool.server")

ROOT = Path(__file__).resolve().parents[2]
READY = model_pool_pb2.MODEL_STATE_READY
ADMIN_TOKEN = "admin-" + secrets.token_hex(16)


@dataclass
class Fleet:
    secret: bytes
    credentials: Credentials
    scheduler: str
    broker: str
    worker: str
    data_endpoint: str
    worker_id: str


async def _eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


@pytest.fixture
async def fleet(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Fleet]:
    # Each test's refusals are logged whatever the tests before it logged within the second.
    monkeypatch.setattr(internal_auth, "log_refusal", internal_auth._RefusalLog())
    secret = secrets.token_bytes(32)
    credentials = Credentials(secret, Identity("model-pool", "trusted"), admin_token=ADMIN_TOKEN)
    internal_auth.setup(credentials)
    repository = tmp_path / "models"
    shutil.copytree(ROOT / "examples" / "models" / "double", repository / "double")
    servers: list[GrpcServer] = []
    try:
        broker = await gpu_broker_server.build(
            Settings(
                redis_url=redis_url,
                gpu_broker=GpuBrokerSettings(
                    listen="127.0.0.1:0",
                    key_prefix=f"trust-{uuid.uuid4().hex[:12]}",
                    use_nvml=False,
                    reserve_mb=0,
                    declared={"local": [GpuSpec(index=0, total_mb=16_384)]},
                ),
                metrics=MetricsSettings(enabled=False),
            )
        )
        broker_address = f"127.0.0.1:{await broker.start()}"
        servers.append(broker)
        scheduler = scheduler_server.build(
            Settings(
                scheduler=SchedulerSettings(address="127.0.0.1:0"), metrics=MetricsSettings(enabled=False)
            )
        )
        scheduler_address = f"127.0.0.1:{await scheduler.start()}"
        servers.append(scheduler)
        worker = await model_pool_server.build(
            Settings(
                model_pool=ModelPoolSettings(
                    address="127.0.0.1:0",
                    data_bind="tcp://127.0.0.1:*",
                    worker_id="worker-real",
                    preload=["double"],
                    inference_threads=1,
                ),
                scheduler=SchedulerSettings(address=scheduler_address),
                gpu_broker=GpuBrokerSettings(address=broker_address),
                metrics=MetricsSettings(enabled=False),
                models=ModelsSettings(repository=repository),
            )
        )
        await worker.start()
        servers.append(worker)
        fleet = Fleet(
            secret,
            credentials,
            scheduler_address,
            broker_address,
            f"127.0.0.1:{worker.port}",
            worker.data_endpoint,
            "worker-real",
        )
        async with aio_channel(scheduler_address) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)

            async def registered_and_ready() -> bool:
                reply = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5)
                return any(
                    w.worker_id == "worker-real"
                    and any(m.model_id == "double" and m.state == READY for m in w.models)
                    for w in reply.workers
                )

            await _eventually(registered_and_ready)
        yield fleet
    finally:
        for server in reversed(servers):
            await server.stop()
        internal_auth.setup(None)


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == internal_auth.__name__ and r.levelno >= logging.WARNING
    ]


def _assert_logged(caplog: pytest.LogCaptureFixture, what: str, *, identity: str = "none") -> None:
    lines = [line for line in _refusals(caplog) if what in line and f"(identity: {identity})" in line]
    assert lines, f"no refusal logged for {what!r} from {identity}: {_refusals(caplog)}"
    assert "127.0.0.1" in lines[-1], lines[-1]  # the caller's address


async def _workers(fleet: Fleet) -> list[str]:
    async with aio_channel(fleet.scheduler) as channel:
        reply = await scheduler_pb2_grpc.SchedulerServiceStub(channel).ListWorkers(
            scheduler_pb2.ListWorkersRequest(), timeout=5
        )
    return [w.worker_id for w in reply.workers]


async def test_a_fake_worker_cannot_register_with_the_scheduler(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    hello = scheduler_pb2.WorkerSessionRequest(
        hello=scheduler_pb2.WorkerHello(
            worker_id="impostor",
            data_endpoint="tcp://127.0.0.1:1",
            grpc_endpoint="127.0.0.1:1",
            node="local",
            repository=["double"],
        )
    )
    report = scheduler_pb2.WorkerSessionRequest(
        report=scheduler_pb2.WorkerReport(
            models=[model_pool_pb2.ModelSlotStatus(model_id="double", state=READY)], free_mb=1_000
        )
    )
    # The refusal comes at the call's start, before a message is read. The calls send nothing
    # until it has come: a message sent as it arrives fails in the client ("Failed
    # execute_batch"), and grpc then reports the client's INTERNAL, not the server's refusal.
    async with grpc.aio.insecure_channel(fleet.scheduler) as channel:  # no credentials
        call = scheduler_pb2_grpc.SchedulerServiceStub(channel).WorkerSession()
        assert await asyncio.wait_for(call.code(), 5) == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(asyncio.InvalidStateError):  # no hello or report can follow
            await call.write(hello)
    # A training job's identity key authenticates it, but only model-pool identities register workers.
    job = Credentials.from_identity_key(fleet.credentials.identity_key(Identity("trainer", "job-7")))
    async with grpc.aio.insecure_channel(
        fleet.scheduler, interceptors=internal_auth.auth_interceptors(job)
    ) as channel:
        call = scheduler_pb2_grpc.SchedulerServiceStub(channel).WorkerSession()
        assert await asyncio.wait_for(call.code(), 5) == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(asyncio.InvalidStateError):
            await call.write(report)
    _assert_logged(caplog, "/loadmaster.v1.SchedulerService/WorkerSession", identity="trainer/job-7")
    assert "impostor" not in await _workers(fleet)
    assert "worker-real" in await _workers(fleet)
    _assert_logged(caplog, "/loadmaster.v1.SchedulerService/WorkerSession")


async def test_b_unloading_a_model_on_the_worker_needs_credentials_and_admin(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    async with grpc.aio.insecure_channel(fleet.worker) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await model_pool_pb2_grpc.ModelPoolServiceStub(channel).Unload(
                model_pool_pb2.UnloadRequest(model_id="double"), timeout=5
            )
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    _assert_logged(caplog, "/loadmaster.v1.ModelPoolService/Unload")

    # A service of the suite (the suite secret, but no admin token) may not unload either.
    interceptors = internal_auth.auth_interceptors(Credentials(fleet.secret, Identity("metrics", "m1")))
    async with grpc.aio.insecure_channel(fleet.worker, interceptors=interceptors) as channel:
        stub = model_pool_pb2_grpc.ModelPoolServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await stub.Unload(model_pool_pb2.UnloadRequest(model_id="double"), timeout=5)
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        _assert_logged(caplog, "/loadmaster.v1.ModelPoolService/Unload", identity="metrics/m1")
        status = await stub.Status(model_pool_pb2.StatusRequest(), timeout=5)
    assert [m.state for m in status.models if m.model_id == "double"] == [READY]


async def _leases(fleet: Fleet) -> list[gpu_broker_pb2.Lease]:
    async with aio_channel(fleet.broker) as channel:
        reply = await gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel).ListLeases(
            gpu_broker_pb2.ListLeasesRequest(), timeout=5
        )
    return list(reply.leases)


async def test_c_another_holders_lease_cannot_be_released_with_its_listed_token(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    (lease,) = await _leases(fleet)  # the worker's lease for `double`, token and all
    assert lease.labels["loadmaster.principal"] == "model-pool/trusted"
    release = gpu_broker_pb2.ReleaseRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token)

    async with grpc.aio.insecure_channel(fleet.broker) as channel:  # no credentials
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel).Release(release, timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    _assert_logged(caplog, "/loadmaster.v1.GpuBrokerService/Release")

    # A training job with its own identity key (`loadmaster keys internal`): the token is not enough.
    job = Credentials.from_identity_key(fleet.credentials.identity_key(Identity("trainer", "job-7")))
    other = internal_auth.auth_interceptors(job)
    async with grpc.aio.insecure_channel(fleet.broker, interceptors=other) as channel:
        stub = gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await stub.Release(release, timeout=5)
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        _assert_logged(caplog, f"release of lease {lease.lease_id}", identity="trainer/job-7")
        # Its own valid credential, behind a second identity header naming the worker: refused.
        with pytest.raises(grpc.aio.AioRpcError) as forged:
            await stub.Release(
                release, timeout=5, metadata=(("x-loadmaster-identity", "model-pool/trusted"),)
            )
        assert forged.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "more than once" in (forged.value.details() or "")
        renewed = await stub.RenewMany(
            gpu_broker_pb2.RenewManyRequest(
                renewals=[
                    gpu_broker_pb2.RenewRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token)
                ]
            ),
            timeout=5,
        )
        assert renewed.results[0].HasField("error"), renewed
    assert [live.lease_id for live in await _leases(fleet)] == [lease.lease_id]


async def _inventory(fleet: Fleet) -> list[int]:
    async with aio_channel(fleet.broker) as channel:
        reply = await gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel).Inventory(
            gpu_broker_pb2.InventoryRequest(), timeout=5
        )
    return [gpu.total_mb for gpu in reply.gpus]


async def test_d_the_gpu_cannot_be_re_registered_as_a_million_mb(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    forged = gpu_broker_pb2.RegisterNodeRequest(
        node="local", gpus=[gpu_broker_pb2.Gpu(index=0, total_mb=1_000_000, name="forged")]
    )
    async with grpc.aio.insecure_channel(fleet.broker) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel).RegisterNode(forged, timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    _assert_logged(caplog, "/loadmaster.v1.GpuBrokerService/RegisterNode")
    assert await _inventory(fleet) == [16_384]


async def test_e_the_strategy_cannot_be_switched(fleet: Fleet, caplog: pytest.LogCaptureFixture) -> None:
    async with grpc.aio.insecure_channel(fleet.scheduler) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await scheduler_pb2_grpc.SchedulerServiceStub(channel).SetStrategy(
                scheduler_pb2.SetStrategyRequest(strategy="round_robin"), timeout=5
            )
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    _assert_logged(caplog, "/loadmaster.v1.SchedulerService/SetStrategy")
    async with aio_channel(fleet.scheduler) as channel:  # the admin credential may
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        assert (
            await stub.GetQueues(scheduler_pb2.GetQueuesRequest(), timeout=5)
        ).strategy == "model_deadline"
        switched = await stub.SetStrategy(scheduler_pb2.SetStrategyRequest(strategy="round_robin"), timeout=5)
    assert switched.previous == "model_deadline"


@contextlib.contextmanager
def _dealer(endpoint: str) -> zmq.asyncio.Socket:  # type: ignore[misc]
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    try:
        yield socket
    finally:
        socket.close()
        context.term()


async def _infer(
    socket: zmq.asyncio.Socket, request: model_pool_pb2.InferRequest, payload: bytes
) -> model_pool_pb2.InferResponse:
    await socket.send_multipart([b"", request.SerializeToString(), payload])
    frames = await asyncio.wait_for(socket.recv_multipart(), 10)
    return model_pool_pb2.InferResponse.FromString(frames[1])


async def test_f_inference_cannot_go_straight_to_the_data_port(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    descriptors, payload = encode_tensors({"x": np.arange(4, dtype=np.float32)})
    request = model_pool_pb2.InferRequest(request_id="stolen-1", model_id="double", inputs=descriptors)
    with _dealer(fleet.data_endpoint) as socket:
        reply = await _infer(socket, request, bytes(payload))
        assert edge_code_name(reply.error_code) == "unauthenticated", reply
        assert not reply.outputs
        _assert_logged(caplog, "data-port request 'stolen-1'")

        # What a gateway of the suite sends is served; the same message sent again is not.
        signed = model_pool_pb2.InferRequest(request_id="signed-1", model_id="double", inputs=descriptors)
        fleet.credentials.with_identity(Identity("gateway", "g1")).sign_envelope(signed.metadata, "signed-1")
        served = await _infer(socket, signed, bytes(payload))
        assert not served.error_code, served
        replayed = await _infer(socket, signed, bytes(payload))
        assert edge_code_name(replayed.error_code) == "unauthenticated", replayed
        _assert_logged(caplog, "data-port request 'signed-1'", identity="gateway/g1")

        # Only gateways send on the data port: a training job's identity key is refused there.
        job = Credentials.from_identity_key(fleet.credentials.identity_key(Identity("trainer", "job-7")))
        theirs = model_pool_pb2.InferRequest(request_id="job-1", model_id="double", inputs=descriptors)
        job.sign_envelope(theirs.metadata, "job-1")
        refused = await _infer(socket, theirs, bytes(payload))
        assert edge_code_name(refused.error_code) == "unauthenticated", refused
