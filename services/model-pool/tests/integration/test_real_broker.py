"""The worker against the real gpu-broker (services/gpu-broker) on the session's Redis."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from loadmaster.common.errors import UnavailableError
from loadmaster.common.ports import free_port
from loadmaster.model_pool.slots import ModelState
from loadmaster.v1 import errors_pb2, gpu_broker_pb2

if TYPE_CHECKING:
    from conftest import BrokerAt


async def test_leases_follow_the_models(
    real_broker: BrokerAt, example_repo: Path, start_worker: Any, make_client: Any
) -> None:
    async with real_broker() as (address, stub):
        async with start_worker(
            example_repo, preload=["double", "policy"], broker_address=address, lease_ttl_s=3.0
        ) as worker:
            leases = (await stub.ListLeases(gpu_broker_pb2.ListLeasesRequest(holder="worker-test"))).leases
            by_model = {lease.labels["model"]: lease for lease in leases}
            assert sorted(by_model) == ["double", "policy"]
            assert dict(by_model["policy"].mb_per_gpu) == {0: 64} and by_model["policy"].node == "local"
            assert worker.pool.status("policy").lease_id == by_model["policy"].lease_id

            client = make_client(worker.data_endpoint)
            reply, outputs = await client.call("double", {"x": np.ones(2, np.float32)})
            assert reply.error_code == errors_pb2.ERROR_CODE_UNSPECIFIED and outputs["x"].tolist() == [
                2.0,
                2.0,
            ]

            await worker.pool.unload("policy")
            leases = (await stub.ListLeases(gpu_broker_pb2.ListLeasesRequest(holder="worker-test"))).leases
            assert [lease.labels["model"] for lease in leases] == ["double"]

            # Someone else frees double's lease: the next renew (every 0.6 s) finds it gone, and
            # the worker takes the same memory again under a new lease: double stays READY.
            lost = by_model["double"]
            await stub.Release(
                gpu_broker_pb2.ReleaseRequest(lease_id=lost.lease_id, fencing_token=lost.fencing_token)
            )
            for _ in range(250):
                if worker.pool.status("double").lease_id != lost.lease_id:
                    break
                await asyncio.sleep(0.02)
            status = worker.pool.status("double")
            assert status.state is ModelState.READY and status.lease_id != lost.lease_id
            leases = (await stub.ListLeases(gpu_broker_pb2.ListLeasesRequest(holder="worker-test"))).leases
            assert [(x.lease_id, x.labels["model"]) for x in leases] == [(status.lease_id, "double")]
            reply, _ = await client.call("double", {"x": np.ones(2, np.float32)})
            assert reply.error_code == errors_pb2.ERROR_CODE_UNSPECIFIED

            await worker.pool.load("policy")
        leases = (await stub.ListLeases(gpu_broker_pb2.ListLeasesRequest(holder="worker-test"))).leases
        assert list(leases) == []  # released at shutdown


async def test_a_model_that_does_not_fit_stays_idle(
    real_broker: BrokerAt, example_repo: Path, start_worker: Any
) -> None:
    async with (
        real_broker(total_mb=50) as (address, _),
        start_worker(example_repo, preload=["policy"], broker_address=address) as worker,
    ):
        status = worker.pool.status("policy")  # 64 MB on a 50 MB card
        assert status.state is ModelState.IDLE and "50" in status.error, status.error


async def test_unreachable_broker_fails_loads_unavailable(example_repo: Path, start_worker: Any) -> None:
    async with start_worker(example_repo, preload=[], broker_address="127.0.0.1:1") as worker:
        with pytest.raises(UnavailableError, match="unreachable"):
            await worker.pool.load("double")
        status = worker.pool.status("double")
        assert status.state is ModelState.IDLE and "unreachable" in status.error


async def test_a_worker_up_before_its_broker_preloads_once_the_broker_serves(
    real_broker: BrokerAt, example_repo: Path, start_worker: Any
) -> None:
    """`loadmaster up` starts every service at once: a worker may ask for its first lease before
    the broker listens. It waits for the broker (bounded) instead of failing its preload (seen in
    CI on a loaded machine: refused by 49 ms)."""
    port = free_port()
    done = asyncio.Event()

    async def broker_later() -> None:
        await asyncio.sleep(1.0)
        async with real_broker(port=port):
            await done.wait()

    later = asyncio.create_task(broker_later())
    try:
        async with start_worker(
            example_repo, preload=["policy"], broker_address=f"127.0.0.1:{port}"
        ) as worker:
            status = worker.pool.status("policy")
            assert status.state is ModelState.READY, status.error
    finally:
        done.set()
        await later
