"""Script calls that overlap leave in shared pipelines (`_coalesce.py`) on a real Redis: each
caller still gets its own reply, a lost script cache is repaired, a caller cancelled before
its batch left never runs, and a Redis that stops answering fails calls within the timeout."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis

from loadmaster.common.clock import FakeClock
from loadmaster.common.errors import UnavailableError
from loadmaster.gpu_broker.leases import AcquireRequest, GpuState, PlacementRequest
from loadmaster.gpu_broker.manager import LeaseManager
from loadmaster.gpu_broker.store import RedisLeaseStore

CALLS = 24


@pytest.fixture
def prefix() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def manager(redis_url: str, prefix: str) -> AsyncIterator[LeaseManager]:
    store = RedisLeaseStore.connect(redis_url, key_prefix=prefix, max_batches_in_flight=1)
    manager = LeaseManager(store, clock=FakeClock(), default_ttl_s=30, default_reserve_mb=0)
    await manager.register_node("n", [GpuState("n", i, total_mb=10_000, reserve_mb=0) for i in range(2)])
    yield manager
    await store.close()


@pytest.fixture
def admin(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


def request(request_id: str, mb: int = 100) -> AcquireRequest:
    return AcquireRequest(request_id, "w", PlacementRequest(mb=mb))


def reads(admin: redis.Redis) -> int:
    return int(admin.info("stats")["total_reads_processed"])


async def test_concurrent_calls_share_round_trips_and_get_their_own_replies(
    manager: LeaseManager, admin: redis.Redis
) -> None:
    before = reads(admin)
    leases = await asyncio.gather(*(manager.acquire(request(f"r{n}", mb=100 + n)) for n in range(CALLS)))
    # One INFO read and a few reads of the batch, far from one read per call.
    assert reads(admin) - before < CALLS // 2
    assert [lease.total_mb for lease in leases] == [100 + n for n in range(CALLS)]
    assert sorted(lease.fencing_token for lease in leases) == list(range(1, CALLS + 1))
    replayed = await asyncio.gather(*(manager.acquire(request(f"r{n}", mb=100 + n)) for n in range(CALLS)))
    assert replayed == leases
    released = await asyncio.gather(
        *(manager.release(lease.lease_id, fencing_token=lease.fencing_token) for lease in leases)
    )
    assert released == [True] * CALLS
    assert sum(g.leased_mb for g in await manager.inventory()) == 0


async def test_a_flushed_script_cache_is_reloaded_and_each_call_runs_once(
    manager: LeaseManager, admin: redis.Redis, prefix: str
) -> None:
    admin.script_flush()
    leases = await asyncio.gather(*(manager.acquire(request(f"r{n}")) for n in range(CALLS)))
    assert len({lease.lease_id for lease in leases}) == CALLS
    assert int(admin.get(f"{prefix}:fence") or 0) == CALLS  # no call ran twice
    assert sum(g.leased_mb for g in await manager.inventory()) == 100 * CALLS


async def test_a_call_cancelled_before_its_batch_left_never_runs(manager: LeaseManager) -> None:
    cancelled = asyncio.ensure_future(manager.acquire(request("gone")))
    await asyncio.sleep(0)  # it has queued its call; the batch leaves on the next turn
    cancelled.cancel()
    kept = await manager.acquire(request("kept"))
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert [lease.lease_id for lease in await manager.leases()] == [kept.lease_id]
    again = await manager.acquire(request("gone"))  # the id was never used: a new grant
    assert again.fencing_token == kept.fencing_token + 1


async def test_a_redis_that_stops_answering_fails_calls_within_the_timeout(
    redis_url: str, prefix: str, admin: redis.Redis
) -> None:
    clock = FakeClock()
    quick = RedisLeaseStore.connect(redis_url, key_prefix=prefix, timeout_s=0.2)
    patient = RedisLeaseStore.connect(redis_url, key_prefix=prefix, timeout_s=10)
    first, second = (
        LeaseManager(store, clock=clock, default_ttl_s=30, default_reserve_mb=0) for store in (quick, patient)
    )
    try:
        await first.register_node("n", [GpuState("n", 0, total_mb=1_000, reserve_mb=0)])
        admin.client_pause(2_000, all=True)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(UnavailableError, match=r"no reply from Redis within 0\.2 s"):
            await asyncio.gather(*(first.acquire(request(f"r{n}")) for n in range(4)))
        assert loop.time() - started < 1.5  # well before the pause ends
        await second.acquire(request("after"))  # waits out the pause
        assert (await first.acquire(request("again"))).holder == "w"  # a fresh connection
    finally:
        await quick.close()
        await patient.close()
