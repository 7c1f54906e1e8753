"""Acquire with wait_s: served in priority then FIFO order, across replicas, with a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
import redis.asyncio as aioredis

from loadmaster.common.config import Settings
from loadmaster.v1 import gpu_broker_pb2 as pb

MakeSettings = Callable[..., Settings]
StartBroker = Callable[..., Awaitable[Any]]  # conftest.start_broker -> Broker(server, stub)


async def _waiting(settings: Settings) -> int:
    client = aioredis.Redis.from_url(settings.redis_url)
    try:
        return int(await client.zcard(f"{settings.gpu_broker.key_prefix}:waiters"))
    finally:
        await client.aclose()


async def _until_waiting(settings: Settings, count: int) -> None:
    deadline = time.monotonic() + 5
    while await _waiting(settings) != count:
        assert time.monotonic() < deadline, f"expected {count} waiters"
        await asyncio.sleep(0.01)


async def test_waiters_are_served_by_priority_then_arrival(
    make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    settings = make_settings()
    a, b = await start_broker(settings), await start_broker(settings)
    big = (await a.stub.Acquire(pb.AcquireRequest(holder="h", node="n1", gpus=[0], mb=10_000))).lease
    small = (await a.stub.Acquire(pb.AcquireRequest(holder="h", node="n1", gpus=[1], mb=6_000))).lease

    order: list[str] = []

    async def wait_for(name: str, stub: Any, priority: int) -> pb.Lease:
        request = pb.AcquireRequest(holder=name, mb=4_000, wait_s=20, priority=priority)
        lease = (await stub.Acquire(request, timeout=30)).lease
        order.append(name)
        return lease

    tasks = []
    for count, (name, stub, priority) in enumerate(
        [("first", a.stub, 0), ("second", b.stub, 0), ("urgent", a.stub, 5)], start=1
    ):
        tasks.append(asyncio.create_task(wait_for(name, stub, priority)))
        await _until_waiting(settings, count)

    # A request that does not wait may not overtake waiters of equal or higher priority.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await b.stub.Acquire(pb.AcquireRequest(holder="late", mb=100))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "waiting request(s)" in (refused.value.details() or "")

    await b.stub.Release(pb.ReleaseRequest(lease_id=small.lease_id, fencing_token=small.fencing_token))
    await _until_waiting(settings, 2)
    for _ in range(100):  # the grant is in Redis; its reply reaches the client a moment later
        if order:
            break
        await asyncio.sleep(0.05)
    assert order == ["urgent"]  # 6000 MB freed: the higher priority goes first, 2000 MB stay free
    await b.stub.Release(pb.ReleaseRequest(lease_id=big.lease_id, fencing_token=big.fencing_token))
    leases = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    # The order Redis granted them in: fencing tokens count grants. (Not `order`: "first" and
    # "second" are granted by two brokers a moment apart, and their replies may cross.)
    tokens = {
        name: lease.fencing_token for name, lease in zip(("first", "second", "urgent"), leases, strict=True)
    }
    assert sorted(tokens, key=tokens.__getitem__) == ["urgent", "first", "second"]
    assert await _waiting(settings) == 0
    inventory = (await a.stub.Inventory(pb.InventoryRequest())).gpus
    assert sum(g.leased_mb for g in inventory) == sum(sum(x.mb_per_gpu.values()) for x in leases) == 12_000


async def test_a_wait_ends_at_its_deadline_and_leaves_the_queue(
    make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    settings = make_settings()
    broker = await start_broker(settings)
    await broker.stub.Acquire(pb.AcquireRequest(holder="h", node="n1", gpus=[0], mb=10_000))
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await broker.stub.Acquire(pb.AcquireRequest(holder="w", node="n1", gpus=[0], mb=500, wait_s=0.5))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "waited 0.5 s" in (refused.value.details() or "")
    assert 0.4 < time.monotonic() - started < 3
    assert await _waiting(settings) == 0
    # The queue is empty again, so a request on the other GPU is granted at once.
    await broker.stub.Acquire(pb.AcquireRequest(holder="w", node="n1", gpus=[1], mb=500))


async def test_a_request_that_can_never_fit_fails_at_once_even_when_waiting(
    make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    broker = await start_broker(make_settings())
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await broker.stub.Acquire(pb.AcquireRequest(holder="w", mb=12_000, wait_s=30))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "can never fit" in (refused.value.details() or "")
    assert "10000 MB" in (refused.value.details() or "")
    assert time.monotonic() - started < 2
    for field, value in (("wait_s", -1.0), ("priority", 1000)):
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await broker.stub.Acquire(pb.AcquireRequest(holder="w", mb=1, **{field: value}))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (bad.value.details() or "")
