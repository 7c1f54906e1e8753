"""SetStrategy over the real gRPC server (and through `loadmaster scheduler use`): queued requests move over."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest

from loadmaster.v1 import scheduler_pb2

from .conftest import READY, SchedulerHarness


async def test_switch_keeps_every_queued_request(scheduler: SchedulerHarness) -> None:
    gateway = await scheduler.gateway()
    worker = await scheduler.worker("w1", ["m"])  # nothing READY: everything waits
    for i in range(12):
        await gateway.enqueue(f"r{i}", "m", client_id=f"c{i % 3}", priority=i % 3)

    async def depth() -> bool:
        queues = (await scheduler.stub.GetQueues(scheduler_pb2.GetQueuesRequest())).queues
        return bool(queues) and queues[0].depth == 12

    await scheduler.eventually(depth)
    for name in ("round_robin", "deadline_aware", "tiered_deadline", "batch_optimized", "priority_tiered"):
        reply = await scheduler.stub.SetStrategy(scheduler_pb2.SetStrategyRequest(strategy=name))
        assert reply.strategy == name and reply.moved == 12
    reply = await scheduler.stub.SetStrategy(scheduler_pb2.SetStrategyRequest(strategy="model_deadline"))
    assert reply.previous == "priority_tiered"
    await worker.report({"m": READY})
    seen: list[str] = []
    for _ in range(12):  # max_inflight 1: grant, complete, next
        while not gateway.grants:
            await gateway.receive()
        grant = gateway.grants.pop(next(iter(gateway.grants)))
        seen.append(grant.request_id)
        await gateway.complete(grant)
    assert sorted(seen) == sorted(f"r{i}" for i in range(12)) and not gateway.rejects


async def test_unknown_strategy_is_invalid_argument(scheduler: SchedulerHarness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await scheduler.stub.SetStrategy(scheduler_pb2.SetStrategyRequest(strategy="fastest"))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "fastest" in (info.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await scheduler.stub.SetStrategy(scheduler_pb2.SetStrategyRequest(strategy="round_robin", policy="x"))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    queues = await scheduler.stub.GetQueues(scheduler_pb2.GetQueuesRequest())
    assert queues.strategy == "model_deadline"  # unchanged


async def test_cli_use_switches_the_running_scheduler(scheduler: SchedulerHarness) -> None:
    address = scheduler.address
    run = [sys.executable, "-m", "loadmaster.cli.main", "scheduler"]
    done = await asyncio.to_thread(
        subprocess.run,
        [*run, "use", "round_robin", "--address", address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "model_deadline -> round_robin" in done.stdout
    queues = await scheduler.stub.GetQueues(scheduler_pb2.GetQueuesRequest())
    assert queues.strategy == "round_robin"
    bad = await asyncio.to_thread(
        subprocess.run,
        [*run, "use", "nope", "--address", address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "unknown strategy 'nope'" in " ".join(bad.stderr.split())
