"""The Redis job store (jobs.py) against a real Redis: ownership, take-over, TTL."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from loadmaster.gateway.jobs import Job, JobState, RedisJobStore


@pytest.fixture()
async def store(redis_url: str) -> AsyncIterator[RedisJobStore]:
    running = RedisJobStore.connect(redis_url, prefix=f"test:jobs:{uuid.uuid4().hex}", ttl_s=0.5)
    yield running
    await running.close()


def new_job(owner: str = "gw-a") -> Job:
    return Job(
        job_id="imgjob-" + uuid.uuid4().hex,
        kind="image",
        state=JobState.QUEUED,
        client="key-1",
        owner=owner,
        attempts=1,
        created_s=1000.0,
        request={"model": "m", "prompt": "p", "n": 1},
    )


async def test_a_job_goes_queued_running_succeeded_and_keeps_its_result(store: RedisJobStore) -> None:
    job = new_job()
    await store.create(job)
    stored = await store.get(job.job_id)
    assert stored is not None and stored.state is JobState.QUEUED and stored.request == job.request
    assert (stored.client, stored.owner, stored.attempts, stored.created_s) == ("key-1", "gw-a", 1, 1000.0)
    assert stored.expires_in_s is None  # unfinished jobs do not expire
    assert await store.active() == [job.job_id]
    assert await store.start(job.job_id, owner="gw-a")
    assert (await store.get(job.job_id)).state is JobState.RUNNING  # type: ignore[union-attr]
    assert await store.finish(job.job_id, owner="gw-a", result_json='{"data":[]}', finished_s=1001.0)
    done = await store.get(job.job_id)
    assert done is not None and done.state is JobState.SUCCEEDED and done.result_json == '{"data":[]}'
    assert done.finished_s == 1001.0 and done.expires_in_s is not None and 0 < done.expires_in_s <= 0.5
    assert await store.active() == []
    assert not await store.finish(job.job_id, owner="gw-a", error={"message": "late"}, finished_s=1002.0)


async def test_only_the_owner_moves_a_job(store: RedisJobStore) -> None:
    job = new_job(owner="gw-a")
    await store.create(job)
    assert not await store.start(job.job_id, owner="gw-b")
    assert not await store.finish(job.job_id, owner="gw-b", error={"message": "x"}, finished_s=1.0)
    assert (await store.get(job.job_id)).state is JobState.QUEUED  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        await store.finish(job.job_id, owner="gw-a", finished_s=1.0)


async def test_a_job_is_taken_over_only_once_its_owner_lapsed(store: RedisJobStore) -> None:
    job = new_job(owner="gw-a")
    await store.create(job)
    await store.start(job.job_id, owner="gw-a")
    await store.mark_alive("gw-a", ttl_s=30)
    assert await store.claim(job.job_id, owner="gw-b") is None  # gw-a is alive
    await store.mark_gone("gw-a")
    taken = await store.claim(job.job_id, owner="gw-b")
    assert (
        taken is not None and taken.owner == "gw-b" and taken.state is JobState.QUEUED and taken.attempts == 2
    )
    await store.mark_alive("gw-b", ttl_s=30)
    assert await store.claim(job.job_id, owner="gw-c") is None  # gw-b holds it now, alive
    assert await store.claim(job.job_id, owner="gw-b") is None  # its own job: nothing to take
    # the old owner's late result is refused; the new owner's is kept
    assert not await store.finish(job.job_id, owner="gw-a", result_json="{}", finished_s=1.0)
    assert await store.finish(job.job_id, owner="gw-b", result_json='{"ok":1}', finished_s=1.0)


async def test_a_dead_owners_mark_lapses_by_itself(store: RedisJobStore) -> None:
    job = new_job(owner="gw-a")
    await store.create(job)
    await store.mark_alive("gw-a", ttl_s=0.2)
    assert await store.claim(job.job_id, owner="gw-b") is None
    deadline = time.monotonic() + 5
    taken = None
    while taken is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        taken = await store.claim(job.job_id, owner="gw-b")
    assert taken is not None and taken.owner == "gw-b"


async def test_a_finished_job_expires_after_the_ttl(store: RedisJobStore) -> None:
    job = new_job()
    await store.create(job)
    await store.finish(job.job_id, owner="gw-a", error={"message": "no", "status": 400}, finished_s=1.0)
    failed = await store.get(job.job_id)
    assert (
        failed is not None
        and failed.state is JobState.FAILED
        and failed.error == {"message": "no", "status": 400}
    )
    deadline = time.monotonic() + 5
    while await store.get(job.job_id) is not None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert await store.get(job.job_id) is None
    assert await store.get("imgjob-never") is None


async def test_claiming_a_finished_or_vanished_job_drops_it_from_the_active_set(store: RedisJobStore) -> None:
    job = new_job()
    await store.create(job)
    await store.finish(job.job_id, owner="gw-a", result_json="{}", finished_s=1.0)
    await store._redis.sadd(f"{store._prefix}:active", job.job_id, "imgjob-gone")  # stale members
    assert await store.claim(job.job_id, owner="gw-b") is None
    assert await store.claim("imgjob-gone", owner="gw-b") is None
    assert await store.active() == []
