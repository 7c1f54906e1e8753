"""The leader lease's Lua scripts against real Redis."""

from __future__ import annotations

import asyncio
import uuid

from loadmaster.scheduler.leadership import Leadership, RedisLeaderStore


async def test_take_renew_release_and_fencing_on_real_redis(redis_url: str) -> None:
    store = RedisLeaderStore.connect(redis_url, key_prefix=f"test:{uuid.uuid4().hex}", timeout_s=2.0)
    try:
        taken, first = await store.try_acquire(holder_id="a", address="127.0.0.1:1", ttl_ms=60_000)
        assert taken and first == Leadership(1, "a", "127.0.0.1:1")
        taken, current = await store.try_acquire(holder_id="b", address="127.0.0.1:2", ttl_ms=60_000)
        assert not taken and current == first  # the standby learns who leads
        assert await store.renew(first, ttl_ms=60_000)
        assert not await store.renew(Leadership(1, "b", "127.0.0.1:2"), ttl_ms=60_000)
        assert not await store.release(Leadership(1, "b", "127.0.0.1:2"))
        assert await store.release(first)
        assert not await store.renew(first, ttl_ms=60_000)  # a released lease cannot come back

        taken, second = await store.try_acquire(holder_id="b", address="127.0.0.1:2", ttl_ms=100)
        assert taken and second.token == 2
        for _ in range(50):  # the 100 ms lease lapses on Redis's own clock
            taken, third = await store.try_acquire(holder_id="c", address="127.0.0.1:3", ttl_ms=60_000)
            if taken:
                break
            await asyncio.sleep(0.02)
        assert taken and third.token == 3
        assert not await store.renew(second, ttl_ms=60_000)  # the lapsed holder cannot extend it
        assert not await store.release(second)  # nor delete its successor's
        taken, current = await store.try_acquire(holder_id="a", address="127.0.0.1:1", ttl_ms=60_000)
        assert not taken and current == third
    finally:
        await store.close()
