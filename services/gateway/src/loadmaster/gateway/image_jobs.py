"""Async image jobs: `x_async: true` stores the request as a job in Redis and runs it here.

The gateway that takes a job owns it and runs it in a task; the outcome (the same body a
synchronous request gets, or the error) is written back to Redis, where it stays
`job_ttl_s`. A background loop renews this gateway's liveness mark and takes over the
unfinished jobs of gateways whose mark lapsed (a crash, a restart, `kill -9`), so a job
submitted just before a restart is run again by the gateway that comes back, up to
`max_attempts` in all. On a clean stop the mark is dropped, so a successor takes the jobs
over at once.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.errors import InternalError, LoadmasterError
from loadmaster.common.gateway_config import ImagesSettings
from loadmaster.gateway.images import ImageRequest
from loadmaster.gateway.jobs import Job, JobState, RedisJobStore

__all__ = ["Generate", "ImageJobs", "JobFailure", "Render"]

log = logging.getLogger(__name__)

# (request, request_id, client_id) -> the PNG files
Generate = Callable[[ImageRequest, str, str], Awaitable[list[bytes]]]
# (request, images, created) -> the response body's JSON text (run off the event loop)
Render = Callable[[ImageRequest, list[bytes], int], Awaitable[str]]
# an exception -> the job's error object ({"message", "type", "param", "code", "status"})
JobFailure = Callable[[Exception], dict[str, Any]]
JOB_KIND = "image"


class ImageJobs:
    def __init__(
        self,
        store: RedisJobStore,
        generate: Generate,
        render: Render,
        failure: JobFailure,
        settings: ImagesSettings,
        *,
        owner: str,
        clock: Clock | None = None,
    ) -> None:
        self._store = store
        self._generate = generate
        self._render = render
        self._failure = failure
        self._settings = settings
        self._owner = owner
        self._clock = clock or SystemClock()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = False

    def drain(self) -> None:
        """The gateway is stopping: a job that fails from now on (the dispatcher refuses new
        calls while draining) stays unfinished, for the next gateway to run."""
        self._stopping = True

    async def start(self) -> None:
        """Start the keep-up loop; its first step marks this gateway alive. Redis being down
        does not stop the gateway from starting: synchronous requests need no Redis."""
        self._loop_task = asyncio.create_task(self._keep_up(), name="image-jobs")

    async def close(self) -> None:
        """Stop running jobs (they stay unfinished in Redis) and hand them to the next gateway."""
        if self._loop_task is not None:
            self._loop_task.cancel()
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *(t for t in [self._loop_task] if t is not None), return_exceptions=True)
        try:
            await self._store.mark_gone(self._owner)
        except Exception:
            log.warning("image jobs: could not drop this gateway's liveness mark", exc_info=True)
        await self._store.close()

    async def submit(self, request: ImageRequest, *, client: str) -> Job:
        job = Job(
            job_id="imgjob-" + secrets.token_hex(12),
            kind=JOB_KIND,
            state=JobState.QUEUED,
            client=client,
            owner=self._owner,
            attempts=1,
            created_s=self._clock.time(),
            request=request.as_dict(),
        )
        await self._store.create(job)
        self._spawn(job)
        return job

    async def get(self, job_id: str) -> Job | None:
        return await self._store.get(job_id)

    def _spawn(self, job: Job) -> None:
        task = asyncio.create_task(self._run(job), name=f"image-job-{job.job_id}")
        self._tasks[job.job_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(job.job_id, None))

    async def _run(self, job: Job) -> None:
        try:
            if not await self._store.start(job.job_id, owner=self._owner):
                return  # another gateway holds it now
            request = ImageRequest.from_dict(job.request)
            try:
                images = await self._generate(request, job.job_id, job.client)
                body = await self._render(request, images, int(self._clock.time()))
            except (LoadmasterError, ValueError) as error:
                if self._stopping:
                    log.info("image job %s left for the next gateway (%s)", job.job_id, error)
                    return
                await self._finish(job, error=self._failure(error))
                return
            await self._finish(job, result_json=body)
        except asyncio.CancelledError:
            raise  # this gateway is stopping: the job stays unfinished for the next one
        except Exception as error:
            log.exception("image job %s failed", job.job_id)
            try:
                await self._finish(
                    job, error=self._failure(InternalError(f"internal error: {type(error).__name__}"))
                )
            except Exception:
                log.exception("image job %s: could not record its failure", job.job_id)

    async def _finish(
        self, job: Job, *, result_json: str | None = None, error: dict[str, Any] | None = None
    ) -> None:
        written = await self._store.finish(
            job.job_id, owner=self._owner, result_json=result_json, error=error, finished_s=self._clock.time()
        )
        if not written:
            log.warning(
                "image job %s was taken over by another gateway; its result here is dropped", job.job_id
            )

    async def _keep_up(self) -> None:
        """Renew the liveness mark and take over orphaned jobs; never dies."""
        settings = self._settings
        period_s = min(settings.owner_ttl_s / 3, settings.recover_interval_s)
        next_recovery = 0.0
        while True:
            started = time.monotonic()
            try:
                await self._store.mark_alive(self._owner, ttl_s=settings.owner_ttl_s)
                if self._clock.monotonic() >= next_recovery:
                    next_recovery = self._clock.monotonic() + settings.recover_interval_s
                    await self._recover()
            except Exception:
                log.exception("image jobs: keep-up step failed")
            took_s = time.monotonic() - started
            if took_s > period_s:
                log.warning("image jobs: a keep-up step took %.2f s (period %.2f s)", took_s, period_s)
            await self._clock.sleep(max(0.0, period_s - took_s))

    async def _recover(self) -> None:
        for job_id in await self._store.active():
            if job_id in self._tasks:
                continue
            job = await self._store.claim(job_id, owner=self._owner)
            if job is None:
                continue
            if job.attempts > self._settings.max_attempts:
                log.warning("image job %s: lost %d times, failing it", job_id, job.attempts - 1)
                error = self._failure(
                    InternalError(f"the job was lost with its gateway {job.attempts - 1} times; not retried")
                )
                await self._finish(job, error=error)
                continue
            log.info("image job %s: taken over (attempt %d)", job_id, job.attempts)
            self._spawn(job)
