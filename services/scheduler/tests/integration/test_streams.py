"""The Scheduler over real gRPC streams on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc
import pytest

from loadmaster.common.config import load_settings
from loadmaster.common.grpc_client import aio_channel
from loadmaster.scheduler.server import build
from loadmaster.v1 import errors_pb2, model_pool_pb2, scheduler_pb2, scheduler_pb2_grpc

if TYPE_CHECKING:
    from conftest import SchedulerHarness

READY = model_pool_pb2.MODEL_STATE_READY
LOADING = model_pool_pb2.MODEL_STATE_LOADING
IDLE = model_pool_pb2.MODEL_STATE_IDLE


async def test_enqueue_grant_complete(scheduler: SchedulerHarness) -> None:
    await scheduler.worker("w1", ["m"], ready=["m"])
    gateway = await scheduler.gateway()
    await gateway.enqueue("r1", "m", priority=1, urgency=0.5)
    grant = await gateway.outcome("r1")
    assert isinstance(grant, scheduler_pb2.Grant)
    assert (grant.worker_id, grant.data_endpoint, grant.generation, grant.attempt) == (
        "w1",
        "tcp://w1:5556",
        1,
        1,
    )
    assert grant.deadline_unix_ns > time.time_ns()
    queues = await scheduler.stub.GetQueues(scheduler_pb2.GetQueuesRequest())
    assert queues.strategy == "model_deadline"
    assert [(q.model_id, q.inflight, q.granted) for q in queues.queues] == [("m", 1, 1)]
    await gateway.complete(grant)

    async def freed() -> bool:
        queues = await scheduler.stub.GetQueues(scheduler_pb2.GetQueuesRequest())
        return queues.queues[0].inflight == 0

    await scheduler.eventually(freed)


async def test_unknown_model_is_not_found(scheduler: SchedulerHarness) -> None:
    await scheduler.worker("w1", ["m"], ready=["m"])
    gateway = await scheduler.gateway()
    await gateway.enqueue("r1", "no-such-model")
    reject = await gateway.outcome("r1")
    assert isinstance(reject, scheduler_pb2.Reject)
    assert reject.error_code == errors_pb2.ERROR_CODE_NOT_FOUND
    assert "no-such-model" in reject.message


async def test_no_worker_is_unavailable(scheduler: SchedulerHarness) -> None:
    gateway = await scheduler.gateway()
    await gateway.enqueue("r1", "m")
    reject = await gateway.outcome("r1")
    assert isinstance(reject, scheduler_pb2.Reject)
    assert reject.error_code == errors_pb2.ERROR_CODE_UNAVAILABLE


async def test_expiry_arrives_on_time_while_the_only_worker_is_busy(scheduler: SchedulerHarness) -> None:
    await scheduler.worker("w1", ["m"], ready=["m"])
    gateway = await scheduler.gateway()
    await gateway.enqueue("busy", "m")
    assert isinstance(await gateway.outcome("busy"), scheduler_pb2.Grant)
    timeout_ms = 100.0
    sent = time.monotonic()
    await gateway.enqueue("late", "m", timeout_ms=timeout_ms)
    reject = await gateway.outcome("late")
    late_ms = (time.monotonic() - sent) * 1000.0 - timeout_ms
    print(f"expiry reject arrived {late_ms:.1f} ms after the deadline")
    assert isinstance(reject, scheduler_pb2.Reject)
    assert reject.error_code == errors_pb2.ERROR_CODE_EXPIRED
    assert -5.0 <= late_ms < 60.0  # typically a few ms on an idle machine


async def test_a_dropped_worker_stream_regrants_to_another_worker(scheduler: SchedulerHarness) -> None:
    first = await scheduler.worker("w1", ["m"], ready=["m"])
    gateway = await scheduler.gateway()
    await gateway.enqueue("r1", "m")
    grant = await gateway.outcome("r1")
    assert isinstance(grant, scheduler_pb2.Grant) and grant.worker_id == "w1"
    await scheduler.worker("w2", ["m"], ready=["m"])
    await first.close()  # the stream drops
    regrant = await gateway.outcome("r1")
    assert isinstance(regrant, scheduler_pb2.Grant)
    assert (regrant.worker_id, regrant.attempt) == ("w2", 2)
    await scheduler.wait_gone("w1")


async def test_a_cold_model_is_loaded_and_granted_only_once_ready(scheduler: SchedulerHarness) -> None:
    worker = await scheduler.worker("w1", ["cold"])
    gateway = await scheduler.gateway()
    await gateway.enqueue("r1", "cold")
    command = await worker.command()
    assert command.WhichOneof("kind") == "load" and command.load == "cold"
    await worker.report({"cold": LOADING})
    receive = asyncio.create_task(gateway.outcome("r1"))
    await asyncio.sleep(0.05)
    assert not receive.done(), "granted before the model was READY"
    await worker.report({"cold": READY}, generation=4)
    grant = await receive
    assert isinstance(grant, scheduler_pb2.Grant)
    assert (grant.worker_id, grant.generation, grant.attempt) == ("w1", 4, 1)


async def test_a_failed_load_rejects_the_waiters(scheduler: SchedulerHarness) -> None:
    worker = await scheduler.worker("w1", ["cold"])
    gateway = await scheduler.gateway()
    await gateway.enqueue("r1", "cold")
    await worker.command()
    await worker.report({"cold": LOADING})
    await worker.report({"cold": IDLE}, error="artifact missing")
    reject = await gateway.outcome("r1")
    assert isinstance(reject, scheduler_pb2.Reject)
    assert reject.error_code == errors_pb2.ERROR_CODE_UNAVAILABLE
    assert "artifact missing" in reject.message


async def test_a_session_must_start_with_hello(scheduler: SchedulerHarness) -> None:
    call = scheduler.stub.Session()
    await call.write(scheduler_pb2.SessionRequest())
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await asyncio.wait_for(call.read(), 5)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_stopping_the_server_ends_open_streams_promptly() -> None:
    settings = load_settings(None, scheduler={"address": "127.0.0.1:0"}, metrics={"enabled": False})
    server = build(settings)
    port = await server.start()
    async with aio_channel(f"127.0.0.1:{port}") as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        session = stub.Session()
        await session.write(scheduler_pb2.SessionRequest(hello=scheduler_pb2.SessionHello(gateway_id="g")))
        worker = stub.WorkerSession()
        await worker.write(scheduler_pb2.WorkerSessionRequest(hello=scheduler_pb2.WorkerHello(worker_id="w")))
        listed = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest())
        while not listed.workers:
            listed = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest())
        started = time.monotonic()
        await server.stop()
        assert await asyncio.wait_for(session.read(), 2) is grpc.aio.EOF
        assert await asyncio.wait_for(worker.read(), 2) is grpc.aio.EOF
        assert time.monotonic() - started < 2.0
