"""A Redis that loses its data under a running worker (issue 25, Found 3): FLUSHALL, then the
node's inventory registered again, here by the test with a smaller GPU (the gpu-broker would
register its declared inventory again by itself). The worker's renewals find their leases gone; it takes the same memory again
under new leases and new fencing tokens, keeps the models that fit, and unloads the one that
no longer does. Loads that keep failing back off instead of retrying at once."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import redis

from loadmaster.common.errors import UnavailableError
from loadmaster.model_pool.slots import ModelState
from loadmaster.v1 import gpu_broker_pb2, gpu_broker_pb2_grpc

WORKER = "worker-test"


def register_again(address: str, *, total_mb: int) -> None:
    with grpc.insecure_channel(address) as channel:
        gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel).RegisterNode(
            gpu_broker_pb2.RegisterNodeRequest(
                node="local", gpus=[gpu_broker_pb2.Gpu(index=0, total_mb=total_mb, name="declared")]
            ),
            timeout=5,
        )


def worker_leases(address: str) -> dict[str, gpu_broker_pb2.Lease]:
    with grpc.insecure_channel(address) as channel:
        leases = gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel).ListLeases(
            gpu_broker_pb2.ListLeasesRequest(holder=WORKER), timeout=5
        )
    return {lease.labels["model"]: lease for lease in leases.leases}


async def test_after_flushall_the_worker_leases_again_and_keeps_what_fits(
    redis_url: str, broker_thread: Any, example_repo: Path, start_worker: Any, make_client: Any
) -> None:
    with broker_thread(total_mb=1_000) as address:
        async with start_worker(
            example_repo, preload=["double", "policy"], broker_address=address, lease_ttl_s=3.0
        ) as worker:
            before = await asyncio.to_thread(worker_leases, address)
            assert sorted(before) == ["double", "policy"]
            double_mb = sum(before["double"].mb_per_gpu.values())
            assert double_mb < 64 == sum(before["policy"].mb_per_gpu.values())

            # Right after a renewal (the next is 0.6 s away, so it cannot come between the two
            # steps below) Redis loses everything, and the node comes back with room for double
            # only (registered by the test before the broker would register it again itself).
            for _ in range(100):
                now = await asyncio.to_thread(worker_leases, address)
                if now["double"].expires_unix_ms != before["double"].expires_unix_ms:
                    break
                await asyncio.sleep(0.01)
            await asyncio.to_thread(redis.Redis.from_url(redis_url).flushall)
            await asyncio.to_thread(register_again, address, total_mb=double_mb + 10)

            for _ in range(200):  # renewals every 0.6 s: settled within a few
                statuses = {s.model_id: s for s in worker.pool.statuses()}
                if statuses["double"].lease_id != before["double"].lease_id and (
                    statuses["policy"].state is ModelState.IDLE
                ):
                    break
                await asyncio.sleep(0.05)
            after = await asyncio.to_thread(worker_leases, address)
            assert sorted(after) == ["double"], after
            renewed = after["double"]
            assert renewed.lease_id == statuses["double"].lease_id != before["double"].lease_id
            assert statuses["double"].state is ModelState.READY
            assert statuses["policy"].state is ModelState.IDLE and "lost" in statuses["policy"].error

            client = make_client(worker.data_endpoint)
            reply, outputs = await client.call("double", {"x": np.ones(2, np.float32)})
            assert reply.error_code == 0 and outputs["x"].tolist() == [2.0, 2.0]

            # The new lease is renewed like the old one was (it outlives its 3 s TTL).
            await asyncio.sleep(4.0)
            assert (await asyncio.to_thread(worker_leases, address))["double"].lease_id == renewed.lease_id

            # policy cannot be had now: the first load fails, the next ones back off.
            with pytest.raises(Exception, match=r"no GPU memory|free"):
                await worker.pool.load("policy")
            with pytest.raises(UnavailableError, match="next attempt in"):
                await worker.pool.load("policy")


async def test_after_flushall_the_broker_registers_again_and_the_worker_keeps_both_models(
    redis_url: str, broker_thread: Any, example_repo: Path, start_worker: Any
) -> None:
    """No help from the test: the broker registers its inventory again when the worker's
    re-acquire finds no GPU (or at its next step), and both models stay under new leases."""
    with broker_thread(total_mb=1_000) as address:
        async with start_worker(
            example_repo, preload=["double", "policy"], broker_address=address, lease_ttl_s=3.0
        ) as worker:
            before = await asyncio.to_thread(worker_leases, address)
            await asyncio.to_thread(redis.Redis.from_url(redis_url).flushall)
            after: dict[str, gpu_broker_pb2.Lease] = {}
            for _ in range(200):
                after = await asyncio.to_thread(worker_leases, address)
                if sorted(after) == ["double", "policy"] and all(
                    after[m].lease_id != before[m].lease_id for m in after
                ):
                    break
                await asyncio.sleep(0.05)
            assert sorted(after) == ["double", "policy"], after
            for model in ("double", "policy"):
                status = worker.pool.status(model)
                assert status.state is ModelState.READY
                assert status.lease_id == after[model].lease_id != before[model].lease_id
