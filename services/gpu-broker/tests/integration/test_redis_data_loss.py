"""Redis that loses its data (FLUSHALL, a restart without persistence) while the broker runs:
the broker registers its inventory again, the first Acquire after the loss is served, and
fencing tokens never repeat. Redis here asks for a password, as the embedded one does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc
import pytest
import redis

from loadmaster.cli.redis_server import EmbeddedRedis
from loadmaster.common.clock import FakeClock
from loadmaster.common.config import Settings
from loadmaster.v1 import gpu_broker_pb2 as pb

MakeSettings = Callable[..., Settings]
StartBroker = Callable[..., Awaitable[Any]]  # conftest.start_broker -> Broker(server, stub)


def _require_password(server: EmbeddedRedis) -> str:
    """The server's URL: the embedded Redis always asks for its password (carried in the URL)."""
    assert server.password
    return server.url


@pytest.fixture
def own_redis() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis().start()
    try:
        yield server
    finally:
        server.stop()


def _admin(server: EmbeddedRedis) -> redis.Redis:
    return redis.Redis(port=server.port, password=server.password, decode_responses=True)


async def _acquire_within(stub: Any, seconds: float, **fields: Any) -> tuple[pb.Lease, int]:
    """The lease of the first Acquire that succeeds, and how many failed before it."""
    deadline = time.monotonic() + seconds
    failures = 0
    while True:
        try:
            return (await stub.Acquire(pb.AcquireRequest(**fields), timeout=5)).lease, failures
        except grpc.aio.AioRpcError as error:
            failures += 1
            assert time.monotonic() < deadline, f"not served within {seconds}s: {error.details()}"
            await asyncio.sleep(0.1)


async def _hold_some(stub: Any) -> list[pb.Lease]:
    leases = [(await stub.Acquire(pb.AcquireRequest(holder="w", mb=1_000))).lease for _ in range(5)]
    released = leases.pop()
    await stub.Release(pb.ReleaseRequest(lease_id=released.lease_id, fencing_token=released.fencing_token))
    return [*leases, released]


async def test_after_flushall_the_next_acquire_is_served_with_a_new_higher_token(
    own_redis: EmbeddedRedis, make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    url = _require_password(own_redis)
    # The FakeClock never moves: no reaper step runs after start, so only the Acquire
    # itself can notice the loss.
    broker = await start_broker(make_settings(redis=url), FakeClock())
    before = await _hold_some(broker.stub)

    _admin(own_redis).flushall()
    started = time.monotonic()
    # Node-scoped, on one GPU: fails with NOT_FOUND ("node 'n1' is not registered") until
    # the inventory is back.
    lease, failures = await _acquire_within(broker.stub, 5.0, holder="w", mb=6_000, node="n1", gpus=[1])
    assert failures == 0 and time.monotonic() - started < 5.0
    assert lease.fencing_token > max(held.fencing_token for held in before)
    again = (await broker.stub.Acquire(pb.AcquireRequest(holder="w", mb=100))).lease
    assert again.fencing_token == lease.fencing_token + 1
    gpus = (await broker.stub.Inventory(pb.InventoryRequest())).gpus
    assert {(g.node, g.index, g.total_mb, g.leased_mb) for g in gpus} == {
        ("n1", 0, 10_000, 100),
        ("n1", 1, 6_000, 6_000),
    }


async def test_inventory_after_flushall_shows_the_gpus_again(
    own_redis: EmbeddedRedis, make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    broker = await start_broker(make_settings(redis=_require_password(own_redis)), FakeClock())
    _admin(own_redis).flushall()
    gpus = (await broker.stub.Inventory(pb.InventoryRequest())).gpus
    assert sorted((g.node, g.index, g.free_mb) for g in gpus) == [("n1", 0, 10_000), ("n1", 1, 6_000)]


async def test_a_reaper_step_registers_the_lost_inventory_without_any_request(
    own_redis: EmbeddedRedis, make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    clock = FakeClock()
    settings = make_settings(redis=_require_password(own_redis))
    await start_broker(settings, clock)
    admin = _admin(own_redis)
    nodes_key = f"{settings.gpu_broker.key_prefix}:nodes"
    assert admin.smembers(nodes_key) == {"n1"}
    admin.flushall()
    for _ in range(200):  # the idle reaper steps at least every 15 s (x 1.2 jitter): 20 s
        clock.advance(0.1)
        await asyncio.sleep(0.005)
        if admin.smembers(nodes_key):
            break
    for _ in range(100):  # a step that started may still be talking to Redis
        if admin.smembers(nodes_key):
            break
        await asyncio.sleep(0.05)
    assert admin.smembers(nodes_key) == {"n1"}


async def test_a_redis_restarted_empty_is_served_within_5_s_and_tokens_do_not_repeat(
    own_redis: EmbeddedRedis, make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    broker = await start_broker(make_settings(redis=_require_password(own_redis)))
    before = await _hold_some(broker.stub)
    own_redis.stop()
    restarted = EmbeddedRedis(port=own_redis.port, password=own_redis.password).start()  # empty: a new folder
    try:
        _require_password(restarted)
        started = time.monotonic()
        lease, _ = await _acquire_within(broker.stub, 5.0, holder="w", mb=1_000, node="n1")
        assert time.monotonic() - started < 5.0
        assert lease.fencing_token > max(held.fencing_token for held in before)
        leases = (await broker.stub.ListLeases(pb.ListLeasesRequest())).leases
        assert [item.lease_id for item in leases] == [lease.lease_id]  # the old ones went with the data
    finally:
        restarted.stop()
