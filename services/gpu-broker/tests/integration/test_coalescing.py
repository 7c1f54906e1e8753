"""Script ops made together leave in one EVALSHA of `OPS_SCRIPT` (`_coalesce.py`) on a real
Redis: each caller still gets its own reply, callers that keep ops going back to back are
split over two calls in flight, an op that fails fails alone, long batches are
split, a lost script cache is repaired, a caller cancelled before its op left never runs, a
Redis that stops answering fails calls within the timeout, and the event subscription
notices a lost connection."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from loadmaster.common.clock import FakeClock
from loadmaster.common.errors import UnavailableError
from loadmaster.gpu_broker import scripts
from loadmaster.gpu_broker._coalesce import ScriptCoalescer
from loadmaster.gpu_broker.leases import AcquireRequest, GpuState, PlacementRequest
from loadmaster.gpu_broker.manager import LeaseManager
from loadmaster.gpu_broker.store import RedisLeaseStore

CALLS = 24


@pytest.fixture
def prefix() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def manager(redis_url: str, prefix: str) -> AsyncIterator[LeaseManager]:
    store = RedisLeaseStore.connect(redis_url, key_prefix=prefix)
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


def script_calls(admin: redis.Redis) -> int:
    return int(admin.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


@contextlib.asynccontextmanager
async def own_coalescer(
    redis_url: str, prefix: str, *, max_ops_per_call: int
) -> AsyncIterator[ScriptCoalescer]:
    """A coalescer on a pool of its own, closed (with its pool) on the way out."""
    pool = aioredis.ConnectionPool.from_url(redis_url, decode_responses=True)
    coalescer = ScriptCoalescer(
        pool,
        script=scripts.OPS_SCRIPT,
        keys=[f"{prefix}:nodes", f"{prefix}:expiry", f"{prefix}:fence"],
        prefix=prefix,
        channel=f"{prefix}:events",
        timeout_s=5,
        max_ops_per_call=max_ops_per_call,
    )
    try:
        yield coalescer
    finally:
        await coalescer.close()
        await pool.aclose()


@pytest.fixture
async def coalescer(redis_url: str, prefix: str) -> AsyncIterator[ScriptCoalescer]:
    """A coalescer of its own (the store's keeps MAX_OPS_PER_CALL), 4 ops per call at most."""
    async with own_coalescer(redis_url, prefix, max_ops_per_call=4) as coalescer:
        yield coalescer


async def test_concurrent_calls_share_round_trips_and_get_their_own_replies(
    manager: LeaseManager, admin: redis.Redis
) -> None:
    before = reads(admin)
    leases = await asyncio.gather(*(manager.acquire(request(f"r{n}", mb=100 + n)) for n in range(CALLS)))
    # One INFO read and a few reads of the batch, far from one read per call.
    assert reads(admin) - before < CALLS // 2
    assert [lease.total_mb for lease in leases] == [100 + n for n in range(CALLS)]
    tokens = sorted(lease.fencing_token for lease in leases)
    assert tokens == list(range(tokens[0], tokens[0] + CALLS))  # each call ran once
    replayed = await asyncio.gather(*(manager.acquire(request(f"r{n}", mb=100 + n)) for n in range(CALLS)))
    assert replayed == leases
    released = await asyncio.gather(
        *(manager.release(lease.lease_id, fencing_token=lease.fencing_token) for lease in leases)
    )
    assert released == [True] * CALLS
    assert sum(g.leased_mb for g in await manager.inventory()) == 0


async def test_ops_made_together_leave_in_one_script_call(manager: LeaseManager, admin: redis.Redis) -> None:
    before = script_calls(admin)
    leases = await asyncio.gather(*(manager.acquire(request(f"r{n}")) for n in range(CALLS)))
    assert script_calls(admin) - before == 1
    before = script_calls(admin)
    await asyncio.gather(
        *(manager.release(lease.lease_id, fencing_token=lease.fencing_token) for lease in leases)
    )
    assert script_calls(admin) - before == 1
    assert sum(g.leased_mb for g in await manager.inventory()) == 0


async def test_callers_in_step_travel_as_two_calls_so_redis_and_the_broker_overlap(
    redis_url: str, prefix: str, admin: redis.Redis
) -> None:
    callers, rounds = 8, 60
    async with own_coalescer(redis_url, prefix, max_ops_per_call=scripts.MAX_OPS_PER_CALL) as coalescer:

        async def caller(n: int, replies: list[int]) -> None:
            for step in range(rounds):
                replies.append(await coalescer.call("leave_queue", 1_000, [f"w{n}-{step}"]))

        await asyncio.gather(*(caller(n, []) for n in range(callers)))  # learns how many are outstanding
        before = script_calls(admin)
        replies: list[int] = []
        await asyncio.gather(*(caller(n, replies) for n in range(callers)))
        calls = script_calls(admin) - before
    assert replies == [0] * (callers * rounds)
    ops_per_call = callers * rounds / calls
    # Half the callers per call (a round's two calls), never one call per turn of all eight,
    # nor one call per op.
    assert 2 <= ops_per_call <= callers / 2 + 0.5, f"{ops_per_call:.1f} ops per call"


async def test_long_batches_are_split_and_an_op_that_fails_fails_alone(
    coalescer: ScriptCoalescer, admin: redis.Redis, prefix: str
) -> None:
    before = script_calls(admin)
    replies = await asyncio.gather(
        coalescer.call("reap", 1_000, [100]),
        coalescer.call("no_such_op", 1_000, []),
        coalescer.call("reap", 1_000, ["not a number"]),  # its redis.call raises inside the op
        *(coalescer.call("leave_queue", 1_000, [f"w{n}"]) for n in range(7)),
        return_exceptions=True,
    )
    assert script_calls(admin) - before == 3  # 10 ops, at most 4 per call
    assert replies[0] == 0
    assert isinstance(replies[1], ResponseError) and "unknown op no_such_op" in str(replies[1])
    assert isinstance(replies[2], ResponseError)
    assert replies[3:] == [0] * 7  # the ops after the failed ones ran
    admin.set(f"{prefix}:probe", "1")  # the connection is still usable after error replies
    assert await coalescer.call("leave_queue", 1_000, ["w"]) == 0


async def test_closing_fails_the_ops_not_yet_answered(coalescer: ScriptCoalescer) -> None:
    assert await coalescer.call("reap", 1_000, [100]) == 0  # connected
    queued = asyncio.ensure_future(coalescer.call("reap", 1_000, [100]))
    await asyncio.sleep(0)  # queued; it would leave at the end of this turn
    await coalescer.close()
    with pytest.raises(RedisConnectionError, match="closed"):
        await asyncio.wait_for(queued, 2)  # not left waiting forever
    with pytest.raises(RedisConnectionError, match="closed"):
        await coalescer.call("reap", 1_000, [100])


async def test_a_flushed_script_cache_is_reloaded_and_each_call_runs_once(
    manager: LeaseManager, admin: redis.Redis, prefix: str
) -> None:
    admin.script_flush()
    leases = await asyncio.gather(*(manager.acquire(request(f"r{n}")) for n in range(CALLS)))
    assert len({lease.lease_id for lease in leases}) == CALLS
    tokens = sorted(lease.fencing_token for lease in leases)
    assert int(admin.get(f"{prefix}:fence") or 0) == tokens[-1] == tokens[0] + CALLS - 1  # none ran twice
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


async def test_the_event_subscription_survives_quiet_and_notices_a_lost_connection(
    manager: LeaseManager, admin: redis.Redis, redis_url: str, prefix: str
) -> None:
    store = RedisLeaseStore.connect(redis_url, key_prefix=prefix)
    subscription = await store.subscribe()
    try:
        # Quiet: the first timeout sends a PING, whose answer keeps the subscription alive.
        assert await subscription.next_message(0.05) is None
        assert await subscription.next_message(5.0) is None  # returns with the PONG
        assert await subscription.next_message(0.05) is None
        lease = await manager.acquire(request("seen"))
        message = await subscription.next_message(1.0)
        assert message is not None and lease.lease_id in message and '"acquired"' in message
        admin.client_kill_filter(_type="pubsub")
        with pytest.raises(UnavailableError, match="lost the Redis event stream"):
            for _ in range(3):  # at most a quiet timeout or two before the closed socket shows
                await subscription.next_message(1.0)
    finally:
        await subscription.close()
        await store.close()
