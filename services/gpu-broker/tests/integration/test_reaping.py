"""Reaping through `LeaseManager` on real Redis, with no background reaper running:
lazy reclaim inside Acquire, and several replicas reaping the same leases at once."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.gpu_broker.leases import AcquireRequest, GpuState, LeaseEventKind, PlacementRequest
from loadmaster.gpu_broker.manager import LeaseManager
from loadmaster.gpu_broker.store import RedisLeaseStore


@pytest.fixture
async def stores(redis_url: str) -> AsyncIterator[list[RedisLeaseStore]]:
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    opened = [RedisLeaseStore.connect(redis_url, key_prefix=prefix) for _ in range(2)]
    yield opened
    for store in opened:
        await store.close()


def managers(stores: list[RedisLeaseStore], clock: FakeClock) -> list[LeaseManager]:
    return [LeaseManager(s, clock=clock, default_ttl_s=5, default_reserve_mb=0) for s in stores]


def request(mb: int, n: int = 0) -> AcquireRequest:
    return AcquireRequest(client_request_id=f"r{n}", holder="w", placement=PlacementRequest(mb=mb))


async def test_acquire_reclaims_expired_leases_first(stores: list[RedisLeaseStore]) -> None:
    clock = FakeClock()
    (manager, _) = managers(stores, clock)
    await manager.register_node("n", [GpuState(node="n", index=0, total_mb=1_000, reserve_mb=0)])
    old = await manager.acquire(request(1_000, 1))
    clock.advance(6)  # past the 5 s TTL; nothing has reaped it yet
    (gpu,) = await manager.inventory()
    assert gpu.leased_mb == 1_000  # expired leases count until reclaimed
    new = await manager.acquire(request(1_000, 2))
    assert new.fencing_token > old.fencing_token
    (gpu,) = await manager.inventory()
    assert gpu.leased_mb == 1_000
    assert [lease.lease_id for lease in await manager.leases()] == [new.lease_id]


async def test_concurrent_reapers_reclaim_each_lease_once(stores: list[RedisLeaseStore]) -> None:
    clock = FakeClock()
    first, second = managers(stores, clock)
    await first.register_node(
        "n", [GpuState(node="n", index=i, total_mb=10_000, reserve_mb=0) for i in range(2)]
    )
    granted = await asyncio.gather(*(first.acquire(request(100, n)) for n in range(60)))
    subscription = await stores[1].subscribe()
    clock.advance(6)

    counts = await asyncio.gather(first.reap(), second.reap(), first.reap(), second.reap())
    assert sum(counts) == len(granted)
    assert all(g.leased_mb == 0 for g in await second.inventory())

    expired: list[str] = []
    while (event := await subscription.next(timeout_s=0.5)) is not None:
        assert event.kind is LeaseEventKind.EXPIRED
        expired.append(event.lease.lease_id)
    await subscription.close()
    assert sorted(expired) == sorted(lease.lease_id for lease in granted)
