"""Async jobs kept in Redis, so they outlive the gateway that took them (docs/images.md).

Keys, under `prefix` (`gateway.images.job_key_prefix`):

    {prefix}:job:{id}        hash: state, kind, client, owner, attempts, created_s, request,
                             result, error, finished_s; expires `ttl_s` after it finishes
    {prefix}:active          set of the ids not finished yet
    {prefix}:alive:{owner}   a gateway's liveness mark (PX owner TTL), renewed while it runs

A job is `queued` (taken, not started), `running`, then `succeeded` (with `result`) or
`failed` (with `error`). Only its owner moves it on; a gateway whose liveness mark lapsed has
its unfinished jobs taken over by another (`claim`), which runs them again. Each change that
depends on what Redis holds is one Lua script, so two gateways never both own a job and a
dead owner's late write is refused. This module does I/O only; the runner (image_jobs.py)
decides when to call it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import RedisError

from loadmaster.common.errors import UnavailableError
from loadmaster.common.redis_url import is_sentinel_url, parse_sentinel_url

__all__ = ["Job", "JobState", "RedisJobStore"]


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED)


@dataclass(frozen=True, slots=True)
class Job:
    job_id: str
    kind: str  # what runs it: "image"
    state: JobState
    client: str  # the API key name (or client id) that submitted it: only it may read it
    owner: str  # the gateway that runs it
    attempts: int
    created_s: float
    request: dict[str, Any]
    result_json: str | None = None  # kept as text: it may hold megabytes of base64 images
    error: dict[str, Any] | None = None
    finished_s: float | None = None
    expires_in_s: float | None = None  # a finished job's time left in Redis


# KEYS[1] job hash; ARGV[1] owner, ARGV[2] new state ("running").
# Returns 1 when the owner still holds the unfinished job and it moved, else 0.
LUA_START = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state or redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
if state == 'succeeded' or state == 'failed' then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[2])
return 1
"""

# KEYS[1] job hash, KEYS[2] active set; ARGV[1] owner, ARGV[2] final state, ARGV[3] the field
# ("result" or "error"), ARGV[4] its JSON, ARGV[5] finished_s, ARGV[6] TTL in ms, ARGV[7] job id.
# Returns 1 when written (the job then expires after the TTL), 0 when the caller no longer owns it.
LUA_FINISH = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state or redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
if state == 'succeeded' or state == 'failed' then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[2], ARGV[3], ARGV[4], 'finished_s', ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
redis.call('SREM', KEYS[2], ARGV[7])
return 1
"""

# KEYS[1] job hash, KEYS[2] the current owner's liveness key, KEYS[3] active set; ARGV[1] the
# owner the caller read, ARGV[2] the new owner, ARGV[3] job id.
# Returns the new attempt count when the job was taken over (state back to queued), 0 when its
# owner changed or is alive, -1 when the job is finished or gone (it leaves the active set).
LUA_CLAIM = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state or state == 'succeeded' or state == 'failed' then
  redis.call('SREM', KEYS[3], ARGV[3])
  return -1
end
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'state', 'queued')
return redis.call('HINCRBY', KEYS[1], 'attempts', 1)
"""


class RedisJobStore:
    """Every Redis call the jobs make."""

    def __init__(
        self, client: aioredis.Redis, *, prefix: str, ttl_s: float, sentinel: Sentinel | None = None
    ) -> None:
        self._redis = client
        self._prefix = prefix
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._sentinel = sentinel
        self._start = client.register_script(LUA_START)
        self._finish = client.register_script(LUA_FINISH)
        self._claim = client.register_script(LUA_CLAIM)

    @classmethod
    def connect(cls, url: str, *, prefix: str, ttl_s: float, timeout_s: float = 5.0) -> RedisJobStore:
        options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
        if is_sentinel_url(url):
            target = parse_sentinel_url(url)
            sentinel = Sentinel(
                list(target.sentinels),
                sentinel_kwargs={**options, "password": target.sentinel_password},
            )
            client = sentinel.master_for(
                target.service_name,
                db=target.db,
                username=target.username,
                password=target.password,
                **options,
            )
            return cls(client, prefix=prefix, ttl_s=ttl_s, sentinel=sentinel)
        return cls(aioredis.Redis.from_url(url, **options), prefix=prefix, ttl_s=ttl_s)

    async def close(self) -> None:
        await self._redis.aclose()
        if self._sentinel is not None:
            await self._sentinel.aclose()

    def _job_key(self, job_id: str) -> str:
        return f"{self._prefix}:job:{job_id}"

    def _alive_key(self, owner: str) -> str:
        return f"{self._prefix}:alive:{owner}"

    @property
    def _active_key(self) -> str:
        return f"{self._prefix}:active"

    async def create(self, job: Job) -> None:
        """Store a new job as unfinished, owned by `job.owner`; `UnavailableError` without Redis."""
        fields = {
            "kind": job.kind,
            "state": job.state.value,
            "client": job.client,
            "owner": job.owner,
            "attempts": job.attempts,
            "created_s": repr(job.created_s),
            "request": json.dumps(job.request, separators=(",", ":")),
        }
        with _unavailable():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(self._job_key(job.job_id), mapping=fields)  # type: ignore[arg-type]
                pipe.sadd(self._active_key, job.job_id)
                await pipe.execute()

    async def start(self, job_id: str, *, owner: str) -> bool:
        """queued -> running, when `owner` still holds the job."""
        return bool(await self._start(keys=[self._job_key(job_id)], args=[owner, JobState.RUNNING.value]))

    async def finish(
        self,
        job_id: str,
        *,
        owner: str,
        result_json: str | None = None,
        error: dict[str, Any] | None = None,
        finished_s: float,
    ) -> bool:
        """Record the outcome (exactly one of `result_json` / `error`); the job expires after the
        TTL. False when `owner` no longer holds it (another gateway took it over)."""
        if (result_json is None) == (error is None):
            raise ValueError("a job finishes with a result or an error")
        if result_json is not None:
            state, field, value = JobState.SUCCEEDED, "result", result_json
        else:
            state, field, value = JobState.FAILED, "error", json.dumps(error, separators=(",", ":"))
        written = await self._finish(
            keys=[self._job_key(job_id), self._active_key],
            args=[
                owner,
                state.value,
                field,
                value,
                repr(finished_s),
                self._ttl_ms,
                job_id,
            ],
        )
        return bool(written)

    async def get(self, job_id: str) -> Job | None:
        """The job, None when unknown or expired; `UnavailableError` without Redis."""
        key = self._job_key(job_id)
        with _unavailable():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hgetall(key)
                pipe.pttl(key)
                raw, ttl_ms = await pipe.execute()
        if not raw:
            return None
        fields = {_text(k): _text(v) for k, v in raw.items()}
        if "state" not in fields:
            return None
        return Job(
            job_id=job_id,
            kind=fields.get("kind", ""),
            state=JobState(fields["state"]),
            client=fields.get("client", ""),
            owner=fields.get("owner", ""),
            attempts=int(fields.get("attempts", "1")),
            created_s=float(fields.get("created_s", "0")),
            request=json.loads(fields.get("request", "{}")),
            result_json=fields.get("result"),
            error=json.loads(fields["error"]) if "error" in fields else None,
            finished_s=float(fields["finished_s"]) if "finished_s" in fields else None,
            expires_in_s=ttl_ms / 1000 if ttl_ms is not None and ttl_ms >= 0 else None,
        )

    async def mark_alive(self, owner: str, *, ttl_s: float) -> None:
        await self._redis.set(self._alive_key(owner), "1", px=max(1, int(ttl_s * 1000)))

    async def mark_gone(self, owner: str) -> None:
        """Drop the liveness mark at once, so another gateway takes the jobs over without waiting."""
        await self._redis.delete(self._alive_key(owner))

    async def active(self) -> list[str]:
        members = await self._redis.smembers(self._active_key)
        return sorted(_text(m) for m in members)

    async def claim(self, job_id: str, *, owner: str) -> Job | None:
        """Take over `job_id` when its owner's liveness mark lapsed; the job as taken, else None."""
        current = await self._redis.hget(self._job_key(job_id), "owner")
        if current is None:
            await self._redis.srem(self._active_key, job_id)
            return None
        previous = _text(current)
        if previous == owner:
            return None
        attempts = await self._claim(
            keys=[self._job_key(job_id), self._alive_key(previous), self._active_key],
            args=[previous, owner, job_id],
        )
        if int(attempts) <= 0:
            return None
        return await self.get(job_id)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@contextmanager
def _unavailable() -> Iterator[None]:
    """Redis errors on a request's path: a clear 503, not an internal error."""
    try:
        yield
    except RedisError as error:
        raise UnavailableError(
            f"the job store (Redis) is unreachable: {type(error).__name__}: {error}"
        ) from None
