"""gRPC calls the compose test makes from the host to ports compose does not publish (run as a
script, so the suite credential it sets up stays out of the pytest process):

    python tests/compose/host_calls.py workers SCHEDULER_ADDRESS
    python tests/compose/host_calls.py leases BROKER_ADDRESS SECONDS CLIENTS

Both sign their calls with the suite secret the environment names (LOADMASTER_INTERNAL_AUTH__*),
as the CLI does, and print one JSON object. `workers`: the scheduler's ListWorkers. `leases`:
lease traffic for the Redis restart. Each client acquires a lease of `lease_mb` (a third of the GPU's free memory
when it starts, so three fit at once and a fourth never does), holds it briefly and releases
it, retrying the release through an outage. Prints one JSON object: the leases granted
(id, granted and released times), the outcome counts, the capacity, and every live lease's
id as ListLeases reports it at the end.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from typing import Any

import grpc

from loadmaster.common import internal_auth
from loadmaster.common.config import load_settings
from loadmaster.common.credentials import Identity
from loadmaster.common.grpc_client import aio_channel
from loadmaster.v1 import gpu_broker_pb2, gpu_broker_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc


async def _client(
    stub: Any, lease_mb: int, stop_at: float, held: list[dict[str, Any]], outcomes: dict[str, int]
) -> None:
    while time.monotonic() < stop_at:
        request = gpu_broker_pb2.AcquireRequest(
            client_request_id=uuid.uuid4().hex, holder="compose-test", mb=lease_mb, ttl_s=30
        )
        try:
            reply = await stub.Acquire(request, timeout=5)
        except grpc.aio.AioRpcError as error:
            outcomes[error.code().name] = outcomes.get(error.code().name, 0) + 1
            await asyncio.sleep(0.05)
            continue
        granted = time.time()
        outcomes["OK"] = outcomes.get("OK", 0) + 1
        await asyncio.sleep(0.02)
        release = gpu_broker_pb2.ReleaseRequest(
            lease_id=reply.lease.lease_id, fencing_token=reply.lease.fencing_token
        )
        released: float | None = None  # until a Release succeeds, the lease counts as held
        last_failed: float | None = None
        for _ in range(200):
            attempt = time.time()
            try:
                outcome = await stub.Release(release, timeout=5)
            except grpc.aio.AioRpcError:
                last_failed = attempt
                await asyncio.sleep(0.05)
                continue
            released = attempt if outcome.released or last_failed is None else last_failed
            break
        held.append({"lease_id": reply.lease.lease_id, "granted": granted, "released": released})


async def workers(address: str) -> dict[str, Any]:
    async with aio_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        reply = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=10)
        return {"workers": [{"worker_id": w.worker_id} for w in reply.workers]}


async def leases(address: str, seconds: float, clients: int) -> dict[str, Any]:
    async with aio_channel(address) as channel:
        stub = gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel)
        inventory = await stub.Inventory(gpu_broker_pb2.InventoryRequest(), timeout=10)
        free_mb = max(gpu.free_mb for gpu in inventory.gpus)
        lease_mb = free_mb // 3
        held: list[dict[str, Any]] = []
        outcomes: dict[str, int] = {}
        stop_at = time.monotonic() + seconds
        await asyncio.gather(*(_client(stub, lease_mb, stop_at, held, outcomes) for _ in range(clients)))
        live = await stub.ListLeases(gpu_broker_pb2.ListLeasesRequest(), timeout=10)
        return {
            "free_mb": free_mb,
            "lease_mb": lease_mb,
            "capacity": free_mb // lease_mb,
            "held": held,
            "outcomes": outcomes,
            "live_lease_ids": [lease.lease_id for lease in live.leases],
        }


if __name__ == "__main__":
    internal_auth.setup_client(load_settings(None), Identity("cli", f"compose-test-{uuid.uuid4().hex[:6]}"))
    if sys.argv[1] == "workers":
        print(json.dumps(asyncio.run(workers(sys.argv[2]))))
    else:
        print(json.dumps(asyncio.run(leases(sys.argv[2], float(sys.argv[3]), int(sys.argv[4])))))
