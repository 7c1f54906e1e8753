"""Best fit as the ACQUIRE script finds it in the `free` index: the same GPU `leases.best_fit`
picks from a snapshot, after grants, releases, outside use and re-registration change it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis

from loadmaster.common.clock import FakeClock
from loadmaster.common.errors import ResourceExhaustedError
from loadmaster.gpu_broker.leases import AcquireRequest, GpuState, PlacementRequest, best_fit
from loadmaster.gpu_broker.manager import LeaseManager
from loadmaster.gpu_broker.store import RedisLeaseStore


@pytest.fixture
def prefix() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def manager(redis_url: str, prefix: str) -> AsyncIterator[LeaseManager]:
    store = RedisLeaseStore.connect(redis_url, key_prefix=prefix)
    yield LeaseManager(store, clock=FakeClock(), default_ttl_s=30, default_reserve_mb=0)
    await store.close()


def request(mb: int, *, node: str = "", gpus: tuple[int, ...] = ()) -> AcquireRequest:
    return AcquireRequest(uuid.uuid4().hex, "w", PlacementRequest(mb=mb, node=node, gpus=gpus))


async def placed(manager: LeaseManager, wanted: AcquireRequest) -> tuple[str, int]:
    """Acquire `wanted` after checking the grant lands where `best_fit` says it should."""
    expected = best_fit(
        [
            g
            for g in await manager.inventory(wanted.placement.node)
            if not wanted.placement.gpus or g.index in wanted.placement.gpus
        ],
        wanted.placement.mb,
    )
    lease = await manager.acquire(wanted)
    (index,) = lease.mb_per_gpu
    assert expected is not None and (lease.node, index) == (expected.node, expected.index)
    return lease.node, index


async def test_ties_go_to_the_first_node_then_the_lowest_index(manager: LeaseManager) -> None:
    for node in ("b", "ab", "a"):  # "a" < "ab" < "b", as Python orders them
        await manager.register_node(node, [GpuState(node, i, total_mb=1_000, reserve_mb=0) for i in (10, 2)])
    assert await placed(manager, request(100)) == ("a", 2)
    assert await placed(manager, request(100)) == ("a", 2)  # now the fullest that still fits
    assert await placed(manager, request(100, node="ab")) == ("ab", 2)
    assert await placed(manager, request(100, node="b", gpus=(10,))) == ("b", 10)
    assert await placed(manager, request(850)) == ("ab", 2)  # 900 free, tied with "b" 10


async def test_release_outside_use_and_reregistration_move_the_best_fit(
    manager: LeaseManager, redis_url: str, prefix: str
) -> None:
    gpus = [GpuState("n", 0, total_mb=8_000, reserve_mb=0), GpuState("n", 1, total_mb=4_000, reserve_mb=0)]
    await manager.register_node("n", gpus)
    first = await manager.acquire(request(3_500))
    assert dict(first.mb_per_gpu) == {1: 3_500}
    assert await placed(manager, request(1_000)) == ("n", 0)  # GPU 1 has 500 left
    await manager.release(first.lease_id, fencing_token=first.fencing_token)
    assert await placed(manager, request(1_000)) == ("n", 1)  # freed: the fuller GPU fits again

    await manager.set_outside("n", {0: 7_000})  # NVML: GPU 0 is nearly full outside leases
    with pytest.raises(ResourceExhaustedError, match="cannot fit"):
        await manager.acquire(request(3_500))
    assert await placed(manager, request(100)) == ("n", 1)
    await manager.register_node("n", gpus)  # re-registered: outside use 0 again, leases kept
    assert await placed(manager, request(3_500)) == ("n", 0)

    m = [GpuState("m", 0, total_mb=2_000, reserve_mb=0), GpuState("m", 1, total_mb=4_000, reserve_mb=0)]
    await manager.register_node("m", m)
    await manager.register_node("m", m[1:])  # GPU 0 dropped: gone from the index too
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    assert raw.zrange(f"{prefix}:free:m", 0, -1) == ["0000000001"]
    assert [x for x in raw.zrange(f"{prefix}:free", 0, -1) if x.startswith("m ")] == ["m 0000000001"]
    raw.close()
