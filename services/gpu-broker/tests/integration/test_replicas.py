"""Several brokers on one Redis: no overcommit, every replica sees every event."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from loadmaster.common.config import Settings
from loadmaster.v1 import gpu_broker_pb2 as pb

MakeSettings = Callable[..., Settings]
StartBroker = Callable[..., Awaitable[Any]]  # conftest.start_broker -> Broker(server, stub)


async def test_two_brokers_never_overcommit(make_settings: MakeSettings, start_broker: StartBroker) -> None:
    settings = make_settings()
    rng = random.Random(7)
    a, b = await start_broker(settings), await start_broker(settings)
    requests = []
    for n in range(200):
        request = pb.AcquireRequest(client_request_id=f"r{n}", holder=f"w{n % 9}", mb=rng.randint(50, 900))
        if n % 3 == 0:
            request.allow_split = True
        if n % 5 == 0:
            request.node, request.gpus[:] = "n1", [n % 2]
        requests.append(request)

    async def attempt(n: int, request: pb.AcquireRequest) -> grpc.StatusCode:
        stub = (a if n % 2 else b).stub
        try:
            await stub.Acquire(request)
        except grpc.aio.AioRpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    codes = await asyncio.gather(*(attempt(n, r) for n, r in enumerate(requests)))
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert codes.count(grpc.StatusCode.OK) > 20 and grpc.StatusCode.RESOURCE_EXHAUSTED in codes

    inventory = (await a.stub.Inventory(pb.InventoryRequest())).gpus
    leases = (await b.stub.ListLeases(pb.ListLeasesRequest())).leases
    assert len(leases) == codes.count(grpc.StatusCode.OK)
    leased: dict[int, int] = defaultdict(int)
    for lease in leases:
        for index, mb in lease.mb_per_gpu.items():
            leased[index] += mb
    for gpu in inventory:
        assert gpu.leased_mb == leased[gpu.index]
        assert gpu.leased_mb + gpu.used_outside_mb <= gpu.total_mb - gpu.reserve_mb

    # Release everything through both replicas at once: the books return to zero.
    await asyncio.gather(
        *(
            (a if i % 2 else b).stub.Release(
                pb.ReleaseRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token)
            )
            for i, lease in enumerate(leases)
        )
    )
    assert all(g.leased_mb == 0 for g in (await a.stub.Inventory(pb.InventoryRequest())).gpus)


async def test_watch_sees_events_from_another_replica(
    make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    settings = make_settings()
    a, b = await start_broker(settings), await start_broker(settings)
    watch = a.stub.Watch(pb.WatchRequest())
    await watch.initial_metadata()
    lease = (await b.stub.Acquire(pb.AcquireRequest(holder="w", mb=100))).lease
    await b.stub.Renew(pb.RenewRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token))
    await b.stub.Release(pb.ReleaseRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token))
    kinds = [(await asyncio.wait_for(watch.read(), 5)).kind for _ in range(3)]
    assert kinds == [
        pb.WatchResponse.KIND_ACQUIRED,
        pb.WatchResponse.KIND_RENEWED,
        pb.WatchResponse.KIND_RELEASED,
    ]
    watch.cancel()
