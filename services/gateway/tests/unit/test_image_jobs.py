"""The async job runner (image_jobs.py) over an in-memory stand-in for the Redis store
(the store itself is tested against real Redis in tests/integration/test_job_store.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from loadmaster.common.errors import InvalidArgumentError, LoadmasterError, UnavailableError
from loadmaster.common.gateway_config import ImagesSettings
from loadmaster.gateway.image_jobs import ImageJobs
from loadmaster.gateway.images import ImageRequest
from loadmaster.gateway.jobs import Job, JobState

REQUEST = ImageRequest(model="m", prompt="p", n=1, width=64, height=64)


class MemoryStore:
    def __init__(self) -> None:
        self.jobs: dict[str, Job] = {}
        self.alive: set[str] = set()
        self.fail_next_mark = False
        self.closed = False

    async def create(self, job: Job) -> None:
        self.jobs[job.job_id] = job

    async def start(self, job_id: str, *, owner: str) -> bool:
        job = self.jobs[job_id]
        if job.owner != owner or job.state.finished:
            return False
        self.jobs[job_id] = dataclasses.replace(job, state=JobState.RUNNING)
        return True

    async def finish(self, job_id: str, *, owner: str, finished_s: float, **outcome: Any) -> bool:
        job = self.jobs[job_id]
        if job.owner != owner or job.state.finished:
            return False
        state = JobState.SUCCEEDED if outcome.get("result_json") is not None else JobState.FAILED
        self.jobs[job_id] = dataclasses.replace(
            job,
            state=state,
            result_json=outcome.get("result_json"),
            error=outcome.get("error"),
            finished_s=finished_s,
        )
        return True

    async def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    async def mark_alive(self, owner: str, *, ttl_s: float) -> None:
        if self.fail_next_mark:
            self.fail_next_mark = False
            raise ConnectionError("redis went away")
        self.alive.add(owner)

    async def mark_gone(self, owner: str) -> None:
        self.alive.discard(owner)

    async def active(self) -> list[str]:
        return sorted(i for i, j in self.jobs.items() if not j.state.finished)

    async def claim(self, job_id: str, *, owner: str) -> Job | None:
        job = self.jobs[job_id]
        if job.owner == owner or job.owner in self.alive:
            return None
        taken = dataclasses.replace(job, owner=owner, state=JobState.QUEUED, attempts=job.attempts + 1)
        self.jobs[job_id] = taken
        return taken

    async def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps = 0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1_000_000.0 + self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds
        await asyncio.sleep(0)


def runner(store: MemoryStore, generate: Any, **settings: Any) -> ImageJobs:
    async def render(request: ImageRequest, images: list[bytes], created: int) -> str:
        return f'{{"n":{len(images)},"created":{created}}}'

    def failure(error: Exception) -> dict[str, Any]:
        status = error.http_status if isinstance(error, LoadmasterError) else 500
        return {"message": str(error), "status": status}

    return ImageJobs(
        store,  # type: ignore[arg-type]
        generate,
        render,
        failure,
        ImagesSettings(**settings),
        owner="gw-1",
        clock=Clock(),
    )


async def settle(jobs: ImageJobs) -> None:
    for _ in range(100):
        if not jobs._tasks:
            return
        await asyncio.sleep(0)


async def test_a_submitted_job_runs_and_keeps_its_result() -> None:
    store = MemoryStore()

    async def generate(request: ImageRequest, request_id: str, client_id: str) -> list[bytes]:
        assert (request, client_id) == (REQUEST, "key")
        return [b"png"]

    jobs = runner(store, generate)
    job = await jobs.submit(REQUEST, client="key")
    assert job.state is JobState.QUEUED and job.owner == "gw-1" and job.request == REQUEST.as_dict()
    await settle(jobs)
    done = await jobs.get(job.job_id)
    assert (
        done is not None
        and done.state is JobState.SUCCEEDED
        and done.result_json == '{"n":1,"created":1000100}'
    )


async def test_a_failing_request_fails_its_job_with_the_error() -> None:
    store = MemoryStore()

    async def generate(request: ImageRequest, request_id: str, client_id: str) -> list[bytes]:
        raise InvalidArgumentError("size 64x64 is not supported")

    jobs = runner(store, generate)
    job = await jobs.submit(REQUEST, client="key")
    await settle(jobs)
    failed = await jobs.get(job.job_id)
    assert failed is not None and failed.state is JobState.FAILED
    assert failed.error == {"message": "size 64x64 is not supported", "status": 400}


async def test_while_draining_a_failing_job_is_left_for_the_next_gateway() -> None:
    store = MemoryStore()
    release = asyncio.Event()

    async def generate(request: ImageRequest, request_id: str, client_id: str) -> list[bytes]:
        await release.wait()
        raise UnavailableError("the gateway is shutting down")

    jobs = runner(store, generate)
    job = await jobs.submit(REQUEST, client="key")
    await asyncio.sleep(0)
    jobs.drain()
    release.set()
    await settle(jobs)
    assert store.jobs[job.job_id].state is JobState.RUNNING  # unfinished: another gateway runs it
    await jobs.close()
    assert "gw-1" not in store.alive and store.closed


async def test_orphaned_jobs_are_taken_over_and_rerun_until_max_attempts() -> None:
    store = MemoryStore()
    ran: list[str] = []

    async def generate(request: ImageRequest, request_id: str, client_id: str) -> list[bytes]:
        ran.append(request_id)
        return [b"png", b"png"]

    def orphan(job_id: str, attempts: int) -> Job:
        return Job(job_id, "image", JobState.RUNNING, "key", "gw-dead", attempts, 1.0, REQUEST.as_dict())

    store.jobs = {"imgjob-a": orphan("imgjob-a", 1), "imgjob-b": orphan("imgjob-b", 3)}
    store.alive = {"gw-dead"}
    jobs = runner(store, generate, max_attempts=3)
    await jobs.start()
    await asyncio.sleep(0)
    assert ran == [] and store.jobs["imgjob-a"].owner == "gw-dead"  # its owner is alive
    store.alive.discard("gw-dead")
    await jobs._recover()
    await settle(jobs)
    assert ran == ["imgjob-a"]
    assert store.jobs["imgjob-a"].state is JobState.SUCCEEDED and store.jobs["imgjob-a"].attempts == 2
    lost = store.jobs["imgjob-b"]
    assert lost.state is JobState.FAILED and lost.attempts == 4 and "3 times" in (lost.error or {})["message"]
    await jobs.close()


async def test_the_keep_up_loop_survives_a_failed_step() -> None:
    store = MemoryStore()

    async def generate(request: ImageRequest, request_id: str, client_id: str) -> list[bytes]:
        return []

    jobs = runner(store, generate)
    await jobs.start()
    store.alive.clear()
    store.fail_next_mark = True
    for _ in range(20):
        await asyncio.sleep(0)
        if "gw-1" in store.alive:
            break
    assert "gw-1" in store.alive  # the step after the failed one renewed the mark
    await jobs.close()
