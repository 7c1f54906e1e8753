"""The admin plane's store and watcher on a real redis-server: compare-and-set, versions,
changes delivered by pub/sub, and a watcher that keeps its last state while Redis is down
and reads again when it is back (its append-only file brings the data back)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadmaster.cli.redis_server import EmbeddedRedis
from loadmaster.common.admin_store import ABSENT, ANY, AdminState, AdminStore, AdminWatcher, ConflictError


async def _in_append_only_file(server: EmbeddedRedis, needle: bytes, *, within_s: float) -> bool:
    """Whether `needle` reaches the server's append-only files within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if any(needle in path.read_bytes() for path in Path(server.data_dir).rglob("*.aof")):
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.fixture()
def own_redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


async def test_compare_and_set_writes_only_over_what_was_read(redis_url: str) -> None:
    store = AdminStore.connect(redis_url, prefix=f"test-{uuid.uuid4().hex}")
    try:
        previous, first = await store.compare_and_set("keys", "a", expected=ABSENT, new={"n": 1})
        assert previous is ABSENT and first == 1
        with pytest.raises(ConflictError):
            await store.compare_and_set("keys", "a", expected=ABSENT, new={"n": 2})
        with pytest.raises(ConflictError):
            await store.compare_and_set("keys", "a", expected={"n": 5}, new={"n": 2})
        previous, second = await store.compare_and_set("keys", "a", expected={"n": 1}, new={"n": 2})
        assert previous == {"n": 1} and second == 2
        await store.compare_and_set("config", "models.known.a.keep_alive_s", expected=ABSENT, new=None)
        await store.compare_and_set("keys", "a", expected=ANY, new=ABSENT)
        state = await store.read()
        assert state.version == 4 and state.keys == {}
        assert state.config == {"models.known.a.keep_alive_s": None}  # JSON null is a value
    finally:
        await store.close()


async def test_a_watcher_sees_a_change_at_once_and_outlives_a_redis_restart(own_redis: EmbeddedRedis) -> None:
    seen: list[AdminState] = []
    changed = asyncio.Event()

    async def on_state(state: AdminState) -> None:
        seen.append(state)
        changed.set()

    writer = AdminStore.connect(own_redis.url, prefix="t")
    watcher = AdminWatcher(
        AdminStore.connect(own_redis.url, prefix="t", timeout_s=0.5), on_state, poll_s=0.5, retry_s=(0.1, 0.2)
    )
    try:
        assert await watcher.start(first_read_timeout_s=5)
        assert seen[-1].version == 0
        changed.clear()
        started = time.monotonic()
        await writer.compare_and_set("guardrails", "g-1", expected=ABSENT, new={"kind": "word"})
        await asyncio.wait_for(changed.wait(), 5)
        assert seen[-1].guardrails == {"g-1": {"kind": "word"}}
        assert time.monotonic() - started < 5  # a bench measures the delay; this bounds it
        # A crash: the AOF holds the change once Redis has written it there. With `appendfsync
        # everysec` that write may wait up to 2 s behind a slow fsync (a loaded CI host), so the
        # kill waits for it rather than testing Redis's write-back timing.
        assert await _in_append_only_file(own_redis, b"g-1", within_s=5)
        await asyncio.to_thread(own_redis._kill)
        await asyncio.sleep(1.0)
        assert not watcher.connected and watcher.state is not None and watcher.state.version == 1
        await asyncio.to_thread(own_redis.start)
        changed.clear()
        await writer.compare_and_set("guardrails", "g-2", expected=ABSENT, new={"kind": "pattern"})
        deadline = time.monotonic() + 10
        while (not seen or "g-2" not in seen[-1].guardrails) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert set(seen[-1].guardrails) == {"g-1", "g-2"} and watcher.connected
    finally:
        await watcher.close()
        await watcher._store.close()
        await writer.close()
