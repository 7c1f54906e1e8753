"""What `loadmaster status` shows: Redis, each service's health and each model's state per worker.

Workers are those the scheduler knows (its ListWorkers), each checked on its own gRPC endpoint;
only when the scheduler lists none is the configured `model_pool.address` checked instead.

The suite is healthy when Redis answers, every service is SERVING and at least one model is
READY on some worker; `problems` says what is not.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import grpc
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel

from loadmaster.common.config import Settings
from loadmaster.common.grpc_client import aio_channel, check_health
from loadmaster.common.redis_url import is_sentinel_url, parse_sentinel_url, redact_redis_url
from loadmaster.common.retry import retry_options
from loadmaster.v1 import model_pool_pb2, scheduler_pb2, scheduler_pb2_grpc

__all__ = ["ModelRow", "RedisRow", "ServiceRow", "SuiteStatus", "collect_status", "redact"]


@dataclass(frozen=True, slots=True)
class ServiceRow:
    name: str
    address: str
    serving: bool


@dataclass(frozen=True, slots=True)
class ModelRow:
    worker_id: str
    model_id: str
    state: str
    inflight: int
    device: str
    vram_mb: int
    error: str


@dataclass(frozen=True, slots=True)
class RedisRow:
    url: str  # password redacted
    reachable: bool
    error: str = ""


@dataclass(frozen=True, slots=True)
class SuiteStatus:
    services: list[ServiceRow]
    models: list[ModelRow]
    redis: RedisRow | None = None  # None: not checked
    problems: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return all(row.serving for row in self.services)

    @property
    def ok(self) -> bool:
        """Redis up (when checked), every service SERVING, at least one model READY."""
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "problems": list(self.problems),
            "redis": asdict(self.redis) if self.redis is not None else None,
            "services": [asdict(row) for row in self.services],
            "models": [asdict(row) for row in self.models],
        }


def redact(url: str) -> str:
    """The URL with its password replaced by `***`."""
    if is_sentinel_url(url):
        return redact_redis_url(url)
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _redis_client(url: str, timeout_s: float) -> redis.Redis:
    """A client of `url`; for a `redis+sentinel://` URL, of the master the Sentinels name."""
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
    }
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **options)
    target = parse_sentinel_url(url)
    sentinel = Sentinel(
        list(target.sentinels), sentinel_kwargs={**options, "password": target.sentinel_password}
    )
    client: redis.Redis = sentinel.master_for(
        target.service_name, db=target.db, username=target.username, password=target.password, **options
    )
    return client


def _ping_redis(url: str, timeout_s: float) -> RedisRow:
    try:
        client = _redis_client(url, timeout_s)
    except ValueError as error:  # a malformed URL (RedisUrlError names the part)
        return RedisRow(redact(url), False, str(error))
    try:
        client.ping()
        return RedisRow(redact(url), True)
    except redis.RedisError as error:
        return RedisRow(redact(url), False, f"{type(error).__name__}: {error}")
    finally:
        client.close()


def _state_name(state: int) -> str:
    return model_pool_pb2.ModelState.Name(state).removeprefix("MODEL_STATE_")  # type: ignore[arg-type]


async def _health(name: str, address: str, timeout_s: float) -> ServiceRow:
    async with aio_channel(address) as channel:
        return ServiceRow(name, address, await check_health(channel, timeout_s=timeout_s))


async def _workers(address: str, timeout_s: float) -> list[scheduler_pb2.WorkerInfo]:
    async with aio_channel(address, options=retry_options()) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        try:
            reply = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return []
    return list(reply.workers)


def _models(workers: list[scheduler_pb2.WorkerInfo]) -> list[ModelRow]:
    return [
        ModelRow(
            worker.worker_id,
            slot.model_id,
            _state_name(slot.state),
            slot.inflight,
            slot.device,
            slot.vram_mb,
            slot.error,
        )
        for worker in workers
        for slot in worker.models
    ]


async def collect_status(
    settings: Settings, *, timeout_s: float = 1.0, check_redis: bool = False
) -> SuiteStatus:
    """Health of every service and the models per worker; with `check_redis`, Redis too
    (`settings.redis_url`; a missing URL is a problem)."""
    workers = await _workers(settings.scheduler.address, timeout_s)
    pool = [(f"model-pool {w.worker_id}", w.grpc_endpoint) for w in workers if w.grpc_endpoint]
    checks = [
        ("gpu-broker", settings.gpu_broker.address),
        ("metrics", settings.metrics.address),
        ("scheduler", settings.scheduler.address),
        *(pool or [("model-pool", settings.model_pool.address)]),
        ("gateway", settings.gateway.address),
    ]
    rows = await asyncio.gather(*(_health(name, address, timeout_s) for name, address in checks))
    models = _models(workers)
    problems = [f"{row.name} at {row.address} is not serving" for row in rows if not row.serving]
    redis_row: RedisRow | None = None
    if check_redis:
        if settings.redis_url:
            redis_row = await asyncio.to_thread(_ping_redis, settings.redis_url, timeout_s)
            if not redis_row.reachable:
                problems.insert(0, f"redis at {redis_row.url} is down: {redis_row.error}")
        else:
            problems.insert(0, "redis: no URL known (set REDIS_URL, or start the suite with `loadmaster up`)")
    if not any(m.state == "READY" for m in models):
        problems.append("no model is READY on any worker")
    return SuiteStatus(list(rows), models, redis_row, problems)
