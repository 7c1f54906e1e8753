"""`serve_as_leader` with real Redis and real in-process schedulers: a standby does not listen
until the leader lets go, and a leader whose lease is taken stops serving."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from loadmaster.common.config import Settings
from loadmaster.common.grpc_client import aio_channel, check_health, wait_for_health
from loadmaster.common.grpc_server import GrpcServer
from loadmaster.scheduler.leadership import LeadershipLostError, serve_as_leader
from loadmaster.scheduler.server import build

STEP_S = 10.0


def _settings(redis_url: str, prefix: str) -> Settings:
    return Settings(
        redis_url=redis_url,
        scheduler={  # type: ignore[arg-type]
            "listen": "127.0.0.1:0",
            # The leader's server starts on the test's loop, and its start collects the garbage of
            # the whole test process (grpc_server._freeze_startup_heap): on a loaded pytest-xdist
            # worker that once held the loop past a 600 ms lease's renewal (28 November).
            "leader_lease": {
                "enabled": True,
                "ttl_ms": 2000,
                "renew_interval_ms": 400,
                "poll_interval_ms": 50,
                "key_prefix": prefix,
            },
        },
        metrics={"enabled": False},  # type: ignore[arg-type]
    )


async def _started(servers: dict[str, GrpcServer], name: str) -> GrpcServer:
    for _ in range(int(STEP_S / 0.02)):
        server = servers.get(name)
        if server is not None and server.port:
            await wait_for_health(f"127.0.0.1:{server.port}", timeout_s=STEP_S)
            return server
        await asyncio.sleep(0.02)
    raise AssertionError(f"scheduler {name} never served")


async def test_standby_serves_after_the_leader_stops_and_a_deposed_leader_stops(redis_url: str) -> None:
    prefix = f"test:{uuid.uuid4().hex}"
    servers: dict[str, GrpcServer] = {}

    def recording(name: str):  # type: ignore[no-untyped-def]
        def make(settings: Settings) -> GrpcServer:
            servers[name] = build(settings)
            return servers[name]

        return make

    leader = asyncio.create_task(serve_as_leader(_settings(redis_url, prefix), recording("a")))
    first = await _started(servers, "a")
    standby = asyncio.create_task(serve_as_leader(_settings(redis_url, prefix), recording("b")))
    await asyncio.sleep(2.5)  # past the lease's TTL: the renewed lease holds
    assert "b" not in servers and not standby.done()  # the standby has built no server

    first.request_stop()  # SIGTERM: drain, then release the lease
    await asyncio.wait_for(leader, STEP_S)
    second = await _started(servers, "b")  # the next poll after the release

    client = aioredis.Redis.from_url(redis_url)
    try:
        record = (await client.get(f"{prefix}:leader")).decode()
        assert record.startswith("2 ")  # the second holder's fencing token
        await client.set(f"{prefix}:leader", "3 intruder 127.0.0.1:1", px=60_000)  # taken from it
        with pytest.raises(LeadershipLostError):
            await asyncio.wait_for(standby, STEP_S)
        assert await client.get(f"{prefix}:leader") == b"3 intruder 127.0.0.1:1"  # not released
    finally:
        await client.aclose()
    async with aio_channel(f"127.0.0.1:{second.port}") as channel:
        assert not await check_health(channel, timeout_s=0.5), "the deposed leader still serves"
