"""A grant survives a failover: with `replica_ack_timeout_ms` the broker answers a state change
only once a replica holds it (WAIT), and answers UNAVAILABLE when none acknowledges in time.
Real Redis: a master and a replica (embedded redis-servers, each with its password). Also:
a fencing counter behind tokens already granted (a promoted replica that missed the last
INCRs) never hands out one of them again."""

from __future__ import annotations

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


def _client(server: EmbeddedRedis) -> redis.Redis:
    return redis.Redis(port=server.port, password=server.password, decode_responses=True)


def _attach(replica: EmbeddedRedis, master: EmbeddedRedis, timeout_s: float = 10.0) -> None:
    """Make `replica` replicate `master`; returns once the master sees it online."""
    _client(master).config_set("repl-diskless-sync-delay", 0)  # not the default 5 s wait for more replicas
    admin = _client(replica)
    admin.config_set("masterauth", master.password)
    admin.replicaof("127.0.0.1", master.port)
    deadline = time.monotonic() + timeout_s
    while _client(master).info("replication").get("slave0", {}).get("state") != "online":
        assert time.monotonic() < deadline, "the replica did not come online"
        time.sleep(0.05)


def _detach(replica: EmbeddedRedis, master: EmbeddedRedis, timeout_s: float = 10.0) -> None:
    _client(replica).replicaof("NO", "ONE")
    deadline = time.monotonic() + timeout_s
    while _client(master).info("replication")["connected_slaves"]:
        assert time.monotonic() < deadline, "the master still counts the replica"
        time.sleep(0.05)


@pytest.fixture
def pair() -> Iterator[tuple[EmbeddedRedis, EmbeddedRedis]]:
    master, replica = EmbeddedRedis(appendonly=False), EmbeddedRedis(appendonly=False)
    try:
        master.start()
        replica.start()
        _attach(replica, master)
        yield master, replica
    finally:
        replica.stop()
        master.stop()


async def test_a_grant_is_answered_only_once_a_replica_holds_it(
    pair: tuple[EmbeddedRedis, EmbeddedRedis], make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    master, replica = pair
    settings = make_settings(redis=master.url, replica_ack_timeout_ms=200)
    broker = await start_broker(settings)
    prefix = settings.gpu_broker.key_prefix

    lease = (await broker.stub.Acquire(pb.AcquireRequest(holder="w", mb=1_000, client_request_id="r1"))).lease
    assert _client(replica).exists(f"{prefix}:lease:{lease.lease_id}")  # WAIT returned: the replica has it

    _detach(replica, master)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await broker.stub.Acquire(pb.AcquireRequest(holder="w", mb=2_000, client_request_id="r2"))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no replica acknowledged" in (caught.value.details() or "")
    assert "replica_ack_timeout_ms" in (caught.value.details() or "")
    # It ran on the master (its outcome was unknown to the caller), so a retry with the same
    # request id gets that lease, once a replica holds it.
    with pytest.raises(grpc.aio.AioRpcError) as renew_failed:
        await broker.stub.Renew(pb.RenewRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token))
    assert renew_failed.value.code() == grpc.StatusCode.UNAVAILABLE

    _attach(replica, master)
    again = (await broker.stub.Acquire(pb.AcquireRequest(holder="w", mb=2_000, client_request_id="r2"))).lease
    assert again.lease_id != lease.lease_id
    assert _client(replica).exists(f"{prefix}:lease:{again.lease_id}")
    listed = (await broker.stub.ListLeases(pb.ListLeasesRequest())).leases
    assert sorted(held.lease_id for held in listed) == sorted([lease.lease_id, again.lease_id])


async def test_with_acks_off_a_master_without_replicas_grants(
    make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    # The session's Redis has no replica: a WAIT would fail every grant.
    broker = await start_broker(make_settings(replica_ack_timeout_ms=0))
    assert (await broker.stub.Acquire(pb.AcquireRequest(holder="w", mb=1_000))).lease.fencing_token > 0


async def test_a_fence_counter_behind_granted_tokens_never_repeats_one(
    redis_url: str, make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    settings = make_settings()
    broker = await start_broker(settings)
    tokens = [
        (await broker.stub.Acquire(pb.AcquireRequest(holder="w", mb=1_000))).lease.fencing_token
        for _ in range(3)
    ]
    # A promoted replica that missed the last INCRs: the counter exists, but behind.
    admin = redis.Redis.from_url(redis_url, decode_responses=True)
    admin.set(f"{settings.gpu_broker.key_prefix}:fence", tokens[0] - 1)
    after = [
        (await broker.stub.Acquire(pb.AcquireRequest(holder="w", mb=1_000))).lease.fencing_token
        for _ in range(2)
    ]
    assert min(after) > max(tokens)
    assert after[1] > after[0]


async def test_a_readonly_reply_drops_the_connection_so_the_next_op_reconnects(
    pair: tuple[EmbeddedRedis, EmbeddedRedis], make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    # The master is demoted without its clients being killed (Sentinel kills them when it
    # reconfigures a server; a demotion by hand or another tool may not): the broker's script
    # connection stays open and gets READONLY. It must drop it, so that its next connection
    # asks again where the master is (through the Sentinels, with a redis+sentinel:// URL).
    master, replica = pair
    broker = await start_broker(make_settings(redis=master.url, replica_ack_timeout_ms=0), FakeClock())
    await broker.stub.Acquire(pb.AcquireRequest(holder="w", mb=1_000))
    assert _script_connections(master) == 1

    _client(replica).replicaof("NO", "ONE")
    _attach(master, replica)  # the old master now replicates the old replica
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await broker.stub.Acquire(pb.AcquireRequest(holder="w", mb=1_000))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "READONLY" in (caught.value.details() or "") or "read only" in (caught.value.details() or "")
    deadline = time.monotonic() + 5
    while _script_connections(master):
        assert time.monotonic() < deadline, "the broker kept its connection to a replica"
        time.sleep(0.05)


def _script_connections(server: EmbeddedRedis) -> int:
    """Connections whose last command was a script call (the broker's coalescer)."""
    return sum(1 for client in _client(server).client_list() if client["cmd"] == "evalsha")
