"""Before memory of a dead holder is granted again, the reaper records the bytes its process
still uses (from NVML, here a fake sampler) as used outside leases."""

from __future__ import annotations

import uuid

import pytest
import redis

from loadmaster.common.clock import FakeClock
from loadmaster.common.errors import ResourceExhaustedError
from loadmaster.gpu_broker.leases import AcquireRequest, GpuState, PlacementRequest
from loadmaster.gpu_broker.manager import LeaseManager
from loadmaster.gpu_broker.reaper import LocalGpus, Reaper
from loadmaster.gpu_broker.reconcile import GpuSample
from loadmaster.gpu_broker.store import RedisLeaseStore


class FakeSampler:
    def __init__(self) -> None:
        self.processes: dict[int, int] = {}

    def sample(self) -> list[GpuSample]:
        return [GpuSample(0, used_mb=500 + sum(self.processes.values()), processes=dict(self.processes))]

    def close(self) -> None:
        pass


async def test_a_dead_holders_memory_in_use_is_not_granted_again(redis_url: str) -> None:
    clock = FakeClock()
    store = RedisLeaseStore.connect(redis_url, key_prefix=f"rec-{uuid.uuid4().hex[:8]}")
    manager = LeaseManager(store, clock=clock, default_ttl_s=10, default_reserve_mb=500)
    sampler = FakeSampler()
    gpus = {"n": [GpuState("n", 0, total_mb=8_500, reserve_mb=500)]}
    reaper = Reaper(
        manager,
        clock=clock,
        inventory=gpus,
        local_gpus=LocalGpus("n", sampler, reserve_mb=500),  # type: ignore[arg-type]
    )
    try:
        await reaper.step()
        held = await manager.acquire(
            AcquireRequest("r1", "job", PlacementRequest(mb=6_000), ttl_s=10, labels={"pid": "4242"})
        )
        sampler.processes = {4242: 5_000}  # the holder uses 5000 MB of its 6000
        await reaper.step()
        assert (await manager.inventory())[0].used_outside_mb == 0

        # The holder stops renewing (hung, still holding 5000 MB); its lease runs out.
        clock.advance(8.0)  # inside the horizon: counted outside already
        await reaper.step()
        assert (await manager.inventory())[0].used_outside_mb == 5_000
        clock.advance(3.0)  # expired: the next acquire reaps it
        with pytest.raises(ResourceExhaustedError, match="free per GPU: n/0=3000 of 3000 MB"):
            await manager.acquire(AcquireRequest("r2", "other", PlacementRequest(mb=4_000)))
        assert [lease.lease_id for lease in await manager.leases()] == []
        assert held.lease_id

        sampler.processes = {}  # the process exits: the memory comes back
        await reaper.step()
        granted = await manager.acquire(AcquireRequest("r3", "other", PlacementRequest(mb=8_000)))
        assert granted.mb_per_gpu == {0: 8_000}
    finally:
        await store.close()


async def test_after_redis_lost_its_data_memory_still_in_use_is_not_granted(redis_url: str) -> None:
    """The lease went with the data, but its holder's process still holds 5000 MB: the
    re-registration that the next Acquire triggers records them before granting anything."""
    clock = FakeClock()
    prefix = f"rec-{uuid.uuid4().hex[:8]}"
    store = RedisLeaseStore.connect(redis_url, key_prefix=prefix)
    manager = LeaseManager(store, clock=clock, default_ttl_s=10, default_reserve_mb=500)
    sampler = FakeSampler()
    gpus = {"n": [GpuState("n", 0, total_mb=8_500, reserve_mb=500)]}
    reaper = Reaper(
        manager,
        clock=clock,
        inventory=gpus,
        local_gpus=LocalGpus("n", sampler, reserve_mb=500),  # type: ignore[arg-type]
    )
    admin = redis.Redis.from_url(redis_url)
    try:
        await reaper.start()
        await manager.acquire(
            AcquireRequest("r1", "job", PlacementRequest(mb=6_000), ttl_s=10, labels={"pid": "4242"})
        )
        sampler.processes = {4242: 5_000}
        admin.delete(*admin.scan_iter(f"{prefix}:*"))  # this broker's share of a FLUSHALL

        with pytest.raises(ResourceExhaustedError, match="free per GPU: n/0=3000 of 3000 MB"):
            await manager.acquire(AcquireRequest("r2", "other", PlacementRequest(mb=4_000, node="n")))
        assert (await manager.inventory())[0].used_outside_mb == 5_000
    finally:
        await reaper.stop()
        await store.close()
        admin.close()


async def test_a_re_registration_carries_the_memory_in_use_itself(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No window between registering the GPUs and recording their memory in use: the
    registration itself carries it (another replica, or another request here, could be granted
    the memory in between). With the separate recording call disabled it is still there."""
    clock = FakeClock()
    prefix = f"rec-{uuid.uuid4().hex[:8]}"
    store = RedisLeaseStore.connect(redis_url, key_prefix=prefix)
    manager = LeaseManager(store, clock=clock, default_ttl_s=10, default_reserve_mb=500)
    sampler = FakeSampler()
    sampler.processes = {4242: 5_000}  # a holder whose lease went with Redis's data
    reaper = Reaper(
        manager,
        clock=clock,
        inventory={"n": [GpuState("n", 0, total_mb=8_500, reserve_mb=500)]},
        local_gpus=LocalGpus("n", sampler, reserve_mb=500),  # type: ignore[arg-type]
    )

    async def not_recorded(node: str, outside: object) -> None:
        return None

    monkeypatch.setattr(manager, "set_outside", not_recorded)
    try:
        assert await reaper.ensure_registered() == ["n"]
        assert (await manager.inventory())[0].used_outside_mb == 5_000
    finally:
        await store.close()
