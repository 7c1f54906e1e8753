"""The acquire script's own memory check, at its boundary, on a real Redis.

The planner in `leases.py` never proposes more than a GPU has free, so over gRPC an
overcommit reaches the script only through a race (a plan made from a stale snapshot). These
tests hand the script such plans directly: exactly the free memory is granted, one MB more is
refused and changes nothing, on one GPU, split across GPUs, next to existing leases, and with
reserve and memory used outside leases counted. The best-fit path (the `free` index) is checked
at the same boundary.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Mapping

import pytest

from loadmaster.gpu_broker.leases import AcquireRequest, GpuState, Placement, PlacementRequest
from loadmaster.gpu_broker.store import Granted, RedisLeaseStore, Snapshot

NOW_MS = 1_000_000
# GPU 0: 10_000 total - 1_000 reserve - 500 outside = 8_500 MB for leases; GPU 1: 6_000.
GPUS = [
    GpuState("n", 0, total_mb=10_000, reserve_mb=1_000, used_outside_mb=500),
    GpuState("n", 1, total_mb=6_000, reserve_mb=0),
]
CAPACITY = {0: 8_500, 1: 6_000}


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[RedisLeaseStore]:
    store = RedisLeaseStore.connect(redis_url, key_prefix=f"test-{uuid.uuid4().hex[:12]}")
    await store.register_node("n", GPUS, now_ms=NOW_MS)
    yield store
    await store.close()


async def acquire(
    store: RedisLeaseStore, mb_per_gpu: Mapping[int, int] | None, *, mb: int = 0
) -> Granted | Snapshot:
    """Commit `mb_per_gpu` on node n as the script's plan (None: the script's own best fit of `mb`)."""
    wanted = sum(mb_per_gpu.values()) if mb_per_gpu else mb
    outcome = await store.acquire(
        AcquireRequest("", "h", PlacementRequest(mb=wanted, node="n", allow_split=True)),
        now_ms=NOW_MS,
        lease_id=uuid.uuid4().hex,
        ttl_ms=60_000,
        placement=Placement("n", dict(mb_per_gpu)) if mb_per_gpu else None,
        best_fit=mb_per_gpu is None,
    )
    assert isinstance(outcome, Granted | Snapshot), outcome
    return outcome


async def leased(store: RedisLeaseStore) -> dict[int, int]:
    return {g.index: g.leased_mb for g in await store.inventory("n", now_ms=NOW_MS)}


async def test_one_mb_over_a_gpus_capacity_is_refused(store: RedisLeaseStore) -> None:
    for index, capacity in CAPACITY.items():
        assert isinstance(await acquire(store, {index: capacity + 1}), Snapshot)
    assert await leased(store) == {0: 0, 1: 0}
    for index, capacity in CAPACITY.items():
        assert isinstance(await acquire(store, {index: capacity}), Granted)
    assert await leased(store) == CAPACITY


async def test_one_mb_over_next_to_existing_leases_is_refused(store: RedisLeaseStore) -> None:
    assert isinstance(await acquire(store, {0: 3_000, 1: 2_500}), Granted)
    assert isinstance(await acquire(store, {0: 5_501}), Snapshot)
    assert isinstance(await acquire(store, {1: 3_501}), Snapshot)
    assert await leased(store) == {0: 3_000, 1: 2_500}
    assert isinstance(await acquire(store, {0: 5_500}), Granted)
    assert isinstance(await acquire(store, {1: 3_500}), Granted)
    assert await leased(store) == CAPACITY
    assert isinstance(await acquire(store, {0: 1}), Snapshot)  # a full GPU takes nothing more
    assert isinstance(await acquire(store, {1: 1}), Snapshot)


async def test_a_split_one_mb_over_on_either_gpu_is_refused_whole(store: RedisLeaseStore) -> None:
    assert isinstance(await acquire(store, {0: 1_000}), Granted)
    free = {0: 7_500, 1: 6_000}
    for over in (0, 1):
        plan = {index: mb + (1 if index == over else 0) for index, mb in free.items()}
        assert isinstance(await acquire(store, plan), Snapshot), plan
        assert await leased(store) == {0: 1_000, 1: 0}  # all or nothing: no GPU was charged
    assert isinstance(await acquire(store, free), Granted)
    assert await leased(store) == CAPACITY


async def test_best_fit_grants_exactly_the_free_memory_and_not_one_mb_more(store: RedisLeaseStore) -> None:
    assert isinstance(await acquire(store, {0: 2_000}), Granted)  # GPU 0: 6_500 free, GPU 1: 6_000
    assert isinstance(await acquire(store, None, mb=6_501), Snapshot)
    assert await leased(store) == {0: 2_000, 1: 0}
    granted = await acquire(store, None, mb=6_500)
    assert isinstance(granted, Granted) and dict(granted.lease.mb_per_gpu) == {0: 6_500}
    assert isinstance(await acquire(store, None, mb=6_001), Snapshot)
    granted = await acquire(store, None, mb=6_000)
    assert isinstance(granted, Granted) and dict(granted.lease.mb_per_gpu) == {1: 6_000}
    assert await leased(store) == CAPACITY
