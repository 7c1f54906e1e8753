"""The leader lease's decisions, on a fake clock over an in-memory store with Redis's semantics
(the Lua scripts themselves run against real Redis in tests/integration/test_leadership_redis.py)."""

from __future__ import annotations

import asyncio

import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.scheduler.leadership import LeaderElection, Leadership

TTL_S = 2.0
RENEW_S = 0.5
POLL_S = 0.25


class MemoryLeaderStore:
    """SET NX PX + INCR, compare-and-renew and compare-and-delete, expiring on the fake clock."""

    def __init__(self, clock: FakeClock) -> None:
        self._clock = clock
        self.token = 0
        self.record: str | None = None
        self.expires_at = 0.0
        self.down = False  # every call raises, as with Redis unreachable
        self.granted: list[int] = []

    def _current(self) -> str | None:
        if self.record is not None and self._clock.monotonic() >= self.expires_at:
            self.record = None
        return self.record

    async def try_acquire(self, *, holder_id: str, address: str, ttl_ms: int) -> tuple[bool, Leadership]:
        if self.down:
            raise ConnectionError("redis down")
        current = self._current()
        if current is not None:
            return False, Leadership.parse(current)
        self.token += 1
        lease = Leadership(self.token, holder_id, address)
        self.record, self.expires_at = lease.record, self._clock.monotonic() + ttl_ms / 1000
        self.granted.append(self.token)
        return True, lease

    async def renew(self, lease: Leadership, *, ttl_ms: int) -> bool:
        if self.down:
            raise ConnectionError("redis down")
        if self._current() != lease.record:
            return False
        self.expires_at = self._clock.monotonic() + ttl_ms / 1000
        return True

    async def release(self, lease: Leadership) -> bool:
        if self._current() != lease.record:
            return False
        self.record = None
        return True


def election(store: MemoryLeaderStore, clock: FakeClock, name: str) -> LeaderElection:
    return LeaderElection(
        store,
        holder_id=name,
        address=f"{name}:50051",
        ttl_s=TTL_S,
        renew_interval_s=RENEW_S,
        poll_interval_s=POLL_S,
        clock=clock,
    )


async def run_for(clock: FakeClock, seconds: float, step_s: float = 0.05) -> None:
    """Advance the fake clock in small steps, letting every task run between steps."""
    for _ in range(round(seconds / step_s)):
        clock.advance(step_s)
        for _ in range(5):
            await asyncio.sleep(0)


@pytest.fixture()
def clock() -> FakeClock:
    return FakeClock()


async def test_a_renewing_leader_keeps_the_lease_and_the_standby_waits(clock: FakeClock) -> None:
    store = MemoryLeaderStore(clock)
    leader = election(store, clock, "a")
    lease = await leader.acquire()
    holding = asyncio.create_task(leader.hold(lease))
    standby = asyncio.create_task(election(store, clock, "b").acquire())
    await run_for(clock, 10 * TTL_S)
    assert not standby.done() and not holding.done()
    assert leader.leads()
    assert store.granted == [1]
    holding.cancel()
    standby.cancel()
    await asyncio.gather(holding, standby, return_exceptions=True)


async def test_the_standby_takes_over_within_ttl_plus_a_poll_with_a_larger_token(clock: FakeClock) -> None:
    store = MemoryLeaderStore(clock)
    leader = election(store, clock, "a")
    first = await leader.acquire()
    holding = asyncio.create_task(leader.hold(first))
    standby = asyncio.create_task(election(store, clock, "b").acquire())
    await run_for(clock, 1.0)
    holding.cancel()  # the leader dies (kill -9): no more renewals, no release
    await asyncio.gather(holding, return_exceptions=True)
    died = clock.monotonic()
    for _ in range(round((TTL_S + POLL_S) / 0.05) + 1):
        if standby.done():
            break
        await run_for(clock, 0.05)
    assert standby.done(), "the standby did not take over within ttl + one poll"
    second = standby.result()
    assert clock.monotonic() - died <= TTL_S + POLL_S + 1e-9
    assert second.token > first.token
    assert (second.holder_id, second.address) == ("b", "b:50051")


async def test_a_planned_release_hands_over_at_the_next_poll(clock: FakeClock) -> None:
    store = MemoryLeaderStore(clock)
    leader = election(store, clock, "a")
    lease = await leader.acquire()
    standby = asyncio.create_task(election(store, clock, "b").acquire())
    await run_for(clock, 0.5)
    await leader.release(lease)
    assert not leader.leads()
    await run_for(clock, POLL_S + 0.05)
    assert standby.done() and standby.result().token == 2


async def test_a_leader_whose_lease_was_taken_steps_down_at_its_next_renewal(clock: FakeClock) -> None:
    store = MemoryLeaderStore(clock)
    leader = election(store, clock, "a")
    lease = await leader.acquire()
    holding = asyncio.create_task(leader.hold(lease))
    store.record = None  # the lease lapsed (say the leader's process was paused) ...
    taken, _ = await store.try_acquire(holder_id="b", address="b:50051", ttl_ms=2000)  # ... and was taken
    assert taken
    await run_for(clock, RENEW_S + 0.15)
    assert holding.done(), "the old leader kept leading after its lease was taken"
    assert not leader.leads()
    assert store.record is not None and store.record.startswith("2 b ")  # renewal never touched it


async def test_a_leader_cut_off_from_redis_steps_down_before_its_lease_can_expire(clock: FakeClock) -> None:
    store = MemoryLeaderStore(clock)
    leader = election(store, clock, "a")
    lease = await leader.acquire()
    holding = asyncio.create_task(leader.hold(lease))
    await run_for(clock, 1.0)
    store.down = True  # renewals now fail; Redis still holds the key until expires_at
    deadline = store.expires_at
    while not holding.done() and clock.monotonic() < deadline + 1.0:
        await run_for(clock, 0.05)
    assert holding.done()
    assert clock.monotonic() < deadline, "the leader led past the moment a standby could take over"
    assert not leader.leads()


async def test_a_standby_never_leads_while_redis_is_unreachable(clock: FakeClock) -> None:
    store = MemoryLeaderStore(clock)
    store.down = True
    standby = asyncio.create_task(election(store, clock, "b").acquire())
    await run_for(clock, 3 * TTL_S)
    assert not standby.done()
    store.down = False
    await run_for(clock, POLL_S + 0.05)
    assert standby.done() and standby.result().token == 1


async def test_fencing_tokens_grow_over_successive_takeovers(clock: FakeClock) -> None:
    store = MemoryLeaderStore(clock)
    tokens = []
    for name in ("a", "b", "c", "a"):
        lease = await election(store, clock, name).acquire()
        tokens.append(lease.token)
        await run_for(clock, TTL_S + 0.05)  # each holder dies without releasing
    assert tokens == sorted(set(tokens)) and len(tokens) == 4
