"""Redis outage and restart: UNAVAILABLE fast while it is down, nothing granted that Redis did
not record, and leases (with their fencing tokens) survive a restart of an AOF Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from loadmaster.cli.redis_server import EmbeddedRedis
from loadmaster.common.config import Settings
from loadmaster.v1 import gpu_broker_pb2 as pb

MakeSettings = Callable[..., Settings]
StartBroker = Callable[..., Awaitable[Any]]  # conftest.start_broker -> Broker(server, stub)


@pytest.fixture
def aof_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(appendonly=True, data_dir=str(tmp_path)).start()
    try:
        yield server
    finally:
        server.stop()


async def _until_ok(call: Callable[[], Awaitable[Any]], timeout_s: float = 15.0) -> tuple[Any, int]:
    """The call's reply once it succeeds, and how many UNAVAILABLE answers came first."""
    deadline = time.monotonic() + timeout_s
    failures = 0
    while True:
        try:
            return await call(), failures
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
            assert time.monotonic() < deadline, f"still unavailable after {timeout_s}s: {error.details()}"
            failures += 1
            await asyncio.sleep(0.1)


async def test_leases_survive_a_redis_restart_and_outage_is_unavailable(
    aof_redis: EmbeddedRedis, make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    broker = await start_broker(make_settings(redis=aof_redis.url))
    stub = broker.stub
    held = (await stub.Acquire(pb.AcquireRequest(holder="w", mb=3_000, ttl_s=120))).lease
    watch = stub.Watch(pb.WatchRequest())
    await watch.initial_metadata()

    aof_redis.stop()
    for call in (
        lambda: stub.Acquire(pb.AcquireRequest(holder="w", client_request_id="during", mb=100), timeout=10),
        lambda: stub.Renew(
            pb.RenewRequest(lease_id=held.lease_id, fencing_token=held.fencing_token), timeout=10
        ),
        lambda: stub.Release(
            pb.ReleaseRequest(lease_id=held.lease_id, fencing_token=held.fencing_token), timeout=10
        ),
    ):
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 3
    with pytest.raises(grpc.aio.AioRpcError) as ended:  # the watch learns it may have missed events
        while True:  # the grant of `held` may reach the watcher first: it was published before
            event = await asyncio.wait_for(watch.read(), 10)
            assert event.lease.lease_id == held.lease_id
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE

    EmbeddedRedis(port=aof_redis.port, appendonly=True, data_dir=aof_redis.data_dir).start()
    # Same request id as the refused call: nothing was recorded then, so it is granted now, once.
    reply, failures = await _until_ok(
        lambda: stub.Acquire(pb.AcquireRequest(holder="w", client_request_id="during", mb=100), timeout=10)
    )
    assert failures <= 3  # the broker's pool reconnects on its own
    again = (await stub.Acquire(pb.AcquireRequest(holder="w", client_request_id="during", mb=100))).lease
    assert again.lease_id == reply.lease.lease_id

    leases = {lease.lease_id: lease for lease in (await stub.ListLeases(pb.ListLeasesRequest())).leases}
    assert set(leases) == {held.lease_id, reply.lease.lease_id}
    assert leases[held.lease_id].fencing_token == held.fencing_token
    assert reply.lease.fencing_token > held.fencing_token  # the counter survived too
    renewed = await stub.Renew(
        pb.RenewRequest(lease_id=held.lease_id, fencing_token=held.fencing_token, ttl_s=120)
    )
    assert renewed.lease.expires_unix_ms >= held.expires_unix_ms
    inventory = (await stub.Inventory(pb.InventoryRequest())).gpus
    assert sum(g.leased_mb for g in inventory) == 3_100

    # The event stream comes back (the hub resubscribes with backoff).
    watch, _ = await _until_ok(lambda: _watching(stub))
    await stub.Release(pb.ReleaseRequest(lease_id=held.lease_id, fencing_token=held.fencing_token))
    event = await asyncio.wait_for(watch.read(), 10)
    assert event.kind == pb.WatchResponse.KIND_RELEASED and event.lease.lease_id == held.lease_id
    watch.cancel()


async def _watching(stub: Any) -> Any:
    watch = stub.Watch(pb.WatchRequest())
    await watch.initial_metadata()
    if watch.done():  # refused at once: raise its status
        await watch.read()
    return watch
