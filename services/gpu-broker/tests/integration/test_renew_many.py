"""RenewMany over real gRPC and Redis: each renewal answered in order with the unary Renew's
semantics (one lost lease never fails the others), in one Redis pipeline, and bounded."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
import redis

from loadmaster.common.clock import FakeClock
from loadmaster.common.config import Settings
from loadmaster.gpu_broker.servicer import MAX_RENEWALS
from loadmaster.v1 import errors_pb2
from loadmaster.v1 import gpu_broker_pb2 as pb

MakeSettings = Callable[..., Settings]
StartBroker = Callable[..., Awaitable[Any]]  # conftest.start_broker -> Broker(server, stub)


def renewal(lease: pb.Lease, *, token: int | None = None, ttl_s: float = 60) -> pb.RenewRequest:
    return pb.RenewRequest(
        lease_id=lease.lease_id, fencing_token=lease.fencing_token if token is None else token, ttl_s=ttl_s
    )


async def test_each_renewal_is_answered_in_order_and_a_lost_one_fails_alone(
    make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    clock = FakeClock()
    broker = await start_broker(make_settings(lease_ttl_s=20.0), clock)
    stub = broker.stub
    live, released, fenced, short = [
        (await stub.Acquire(pb.AcquireRequest(holder="w", mb=100, ttl_s=ttl))).lease
        for ttl in (20, 20, 20, 5)
    ]
    await stub.Release(pb.ReleaseRequest(lease_id=released.lease_id, fencing_token=released.fencing_token))
    clock.advance(10)  # `short` expired 5 s ago

    reply = await stub.RenewMany(
        pb.RenewManyRequest(
            renewals=[
                renewal(live),
                renewal(released),
                renewal(fenced, token=fenced.fencing_token + 100),
                renewal(short),
                renewal(fenced),
            ]
        )
    )

    kinds = [result.WhichOneof("result") for result in reply.results]
    assert kinds == ["lease", "error", "error", "error", "lease"]
    now_ms = int(clock.time() * 1000)
    assert reply.results[0].lease.lease_id == live.lease_id
    assert reply.results[0].lease.expires_unix_ms == now_ms + 60_000
    assert reply.results[4].lease.lease_id == fenced.lease_id
    assert reply.results[4].lease.expires_unix_ms == now_ms + 60_000
    errors = [reply.results[n].error for n in (1, 2, 3)]
    assert [e.code for e in errors] == [errors_pb2.ERROR_CODE_FAILED_PRECONDITION] * 3
    assert "not live" in errors[0].message
    assert "stale" in errors[1].message
    assert "expired" in errors[2].message
    listed = (await stub.ListLeases(pb.ListLeasesRequest(holder="w"))).leases
    assert sorted(lease.lease_id for lease in listed) == sorted([live.lease_id, fenced.lease_id])


async def test_renewals_of_one_call_share_a_redis_round_trip(
    make_settings: MakeSettings, start_broker: StartBroker, redis_url: str
) -> None:
    broker = await start_broker(make_settings())
    stub = broker.stub
    leases = [(await stub.Acquire(pb.AcquireRequest(holder="w", mb=10))).lease for _ in range(24)]
    admin = redis.Redis.from_url(redis_url, decode_responses=True)
    before = int(admin.info("stats")["total_reads_processed"])
    reply = await stub.RenewMany(pb.RenewManyRequest(renewals=[renewal(lease) for lease in leases]))
    reads = int(admin.info("stats")["total_reads_processed"]) - before
    assert [r.lease.lease_id for r in reply.results] == [lease.lease_id for lease in leases]
    assert reads < 8, reads  # one INFO, a pipeline read or a few; not one read per renewal


async def test_empty_and_oversized_calls(make_settings: MakeSettings, start_broker: StartBroker) -> None:
    broker = await start_broker(make_settings())
    assert list((await broker.stub.RenewMany(pb.RenewManyRequest())).results) == []
    too_many = [pb.RenewRequest(lease_id=f"l{n}", fencing_token=1) for n in range(MAX_RENEWALS + 1)]
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await broker.stub.RenewMany(pb.RenewManyRequest(renewals=too_many))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
