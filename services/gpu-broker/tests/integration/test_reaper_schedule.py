"""When the reaper runs on real Redis: at the first lease expiry (planned again when this
replica grants a lease that expires sooner), at least every `idle_interval_s` on a host without
GPUs, every `interval_s` with them; gauges every step."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Mapping

import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.gpu_broker.leases import AcquireRequest, GpuState, PlacementRequest
from loadmaster.gpu_broker.manager import LeaseManager
from loadmaster.gpu_broker.reaper import LocalGpus, Reaper
from loadmaster.gpu_broker.store import RedisLeaseStore

GPUS = {"n": [GpuState(node="n", index=0, total_mb=1_000, reserve_mb=0)]}


class Recorder:
    def __init__(self) -> None:
        self.samples: list[tuple[str, float]] = []

    def record(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        self.samples.append((name, value))


@pytest.fixture
async def manager(redis_url: str) -> AsyncIterator[LeaseManager]:
    store = RedisLeaseStore.connect(redis_url, key_prefix=f"sched-{uuid.uuid4().hex[:12]}")
    yield LeaseManager(store, clock=FakeClock(), default_ttl_s=30, default_reserve_mb=0)
    await store.close()


def reaper(manager: LeaseManager, **options: object) -> Reaper:
    clock = manager._clock  # type: ignore[attr-defined]
    return Reaper(manager, clock=clock, inventory=GPUS, interval_s=1.0, idle_interval_s=5.0, **options)  # type: ignore[arg-type]


async def test_an_idle_broker_steps_every_few_seconds_and_at_the_first_expiry(manager: LeaseManager) -> None:
    r = reaper(manager)
    await r.step()  # registers the node
    assert 4.0 <= await r._next_delay() <= 6.0  # no lease: idle interval (with jitter)
    await manager.acquire(AcquireRequest("r1", "w", PlacementRequest(mb=100), ttl_s=2))
    assert await r._next_delay() == pytest.approx(2.01, abs=0.001)  # right after it expires
    manager._clock.advance(2.5)  # type: ignore[attr-defined]
    assert await r._next_delay() == 0  # expired, not reaped yet: at once
    r._stepped_at_once = True  # as when the last step ran at once for it and left it (Redis trouble)
    assert await r._next_delay() == pytest.approx(0.05)  # soon, not in a busy loop
    assert await r.step() == 1


async def test_a_host_with_gpus_steps_every_interval(manager: LeaseManager) -> None:
    r = reaper(manager, local_gpus=LocalGpus("n", sampler=None, reserve_mb=0))  # type: ignore[arg-type]
    assert 0.8 <= await r._next_delay() <= 1.2


async def test_gauges_are_recorded_every_step(manager: LeaseManager) -> None:
    # Every step, not only on change: a reading the reporter could not deliver (the metrics
    # service not up yet) is sent again at the next step.
    telemetry = Recorder()
    r = reaper(manager, telemetry=telemetry)
    await r.step()
    assert ("free_mb", 1_000) in telemetry.samples and ("waiters", 0) in telemetry.samples
    telemetry.samples.clear()
    await manager.acquire(AcquireRequest("r1", "w", PlacementRequest(mb=100)))
    await r.step()
    assert sorted(telemetry.samples) == [
        ("free_mb", 900),
        ("lease_mb", 100),
        ("outside_mb", 0),
        ("waiters", 0),
    ]


async def test_a_grant_expiring_before_the_next_step_wakes_the_reaper(manager: LeaseManager) -> None:
    clock: FakeClock = manager._clock  # type: ignore[attr-defined]
    r = Reaper(manager, clock=clock, inventory=GPUS, interval_s=1.0, idle_interval_s=60.0)
    await r.start()  # registers the node; next step planned 48-72 s ahead
    try:
        await manager.acquire(AcquireRequest("r1", "w", PlacementRequest(mb=100), ttl_s=2))
        for _ in range(200):  # 10 s of broker time, far before the planned step
            clock.advance(0.05)
            await asyncio.sleep(0.005)
            if await manager.next_expiry_ms() is None:
                break
        assert await manager.next_expiry_ms() is None  # reaped just after its expiry
        assert clock.monotonic() - 1000.0 < 5.0
    finally:
        await r.stop()


async def test_a_planned_step_is_not_pushed_back_by_time_passing_before_its_sleep_starts(
    manager: LeaseManager,
) -> None:
    clock: FakeClock = manager._clock  # type: ignore[attr-defined]
    r = reaper(manager)
    waiting = asyncio.ensure_future(r._sleep_or_replan(5.0))
    await asyncio.sleep(0)  # planned: its sleeping task is created but has not run yet
    clock.advance(4.0)
    await asyncio.sleep(0)
    clock.advance(1.5)  # 5.5 s after planning: due
    assert await asyncio.wait_for(waiting, 5.0) is True


async def test_gauges_are_reported_soon_after_a_burst_of_grants(manager: LeaseManager) -> None:
    clock: FakeClock = manager._clock  # type: ignore[attr-defined]
    telemetry = Recorder()
    r = Reaper(manager, clock=clock, inventory=GPUS, idle_interval_s=60.0, telemetry=telemetry)
    await r.start()  # one step now; the next is 48-72 s ahead
    try:
        telemetry.samples.clear()
        for n in range(3):
            await manager.acquire(AcquireRequest(f"r{n}", "w", PlacementRequest(mb=100)))
        for _ in range(100):  # 1 s of broker time
            if any(name == "waiters" for name, _ in telemetry.samples):  # the last one recorded
                break
            clock.advance(0.01)
            await asyncio.sleep(0.005)
        assert sorted(telemetry.samples) == [
            ("free_mb", 700),
            ("lease_mb", 300),
            ("outside_mb", 0),
            ("waiters", 0),
        ]
    finally:
        await r.stop()


async def test_gauges_are_reported_soon_after_a_release(manager: LeaseManager) -> None:
    clock: FakeClock = manager._clock  # type: ignore[attr-defined]
    telemetry = Recorder()
    r = Reaper(manager, clock=clock, inventory=GPUS, idle_interval_s=60.0, telemetry=telemetry)

    async def reported() -> list[tuple[str, float]]:
        for _ in range(100):  # 1 s of broker time
            if any(name == "waiters" for name, _ in telemetry.samples):  # the last one recorded
                break
            clock.advance(0.01)
            await asyncio.sleep(0.005)
        samples = sorted(telemetry.samples)
        telemetry.samples.clear()
        return samples

    await r.start()  # one step now; the next is 48-72 s ahead
    try:
        telemetry.samples.clear()
        lease = await manager.acquire(AcquireRequest("r0", "w", PlacementRequest(mb=100)))
        assert ("lease_mb", 100) in await reported()
        assert await manager.release(lease.lease_id, fencing_token=lease.fencing_token)
        assert await reported() == [("free_mb", 1000), ("lease_mb", 0), ("outside_mb", 0), ("waiters", 0)]
    finally:
        await r.stop()
