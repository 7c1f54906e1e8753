"""Acquire / renew / release over real gRPC and Redis."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.common.config import Settings
from loadmaster.v1 import gpu_broker_pb2 as pb

MakeSettings = Callable[..., Settings]
StartBroker = Callable[..., Awaitable[Any]]  # conftest.start_broker -> Broker(server, stub)


def free_by_gpu(reply: pb.InventoryResponse) -> dict[tuple[str, int], int]:
    return {(g.node, g.index): g.free_mb for g in reply.gpus}


async def test_acquire_renew_release_round_trip(
    make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    clock = FakeClock()
    broker = await start_broker(make_settings(lease_ttl_s=20.0), clock)
    stub = broker.stub
    reply = await stub.Acquire(
        pb.AcquireRequest(client_request_id="r1", holder="worker-1", mb=4_000, labels={"model": "m"})
    )
    lease = reply.lease
    # Best fit: the 6_000 MB GPU is the fullest one that still fits.
    assert (lease.node, dict(lease.mb_per_gpu)) == ("n1", {1: 4_000})
    assert lease.fencing_token > 0 and dict(lease.labels) == {"model": "m"}
    assert lease.expires_unix_ms - lease.created_unix_ms == 20_000
    assert free_by_gpu(await stub.Inventory(pb.InventoryRequest())) == {("n1", 0): 10_000, ("n1", 1): 2_000}
    listed = await stub.ListLeases(pb.ListLeasesRequest(holder="worker-1"))
    assert [item.lease_id for item in listed.leases] == [lease.lease_id]
    assert not (await stub.ListLeases(pb.ListLeasesRequest(holder="someone-else"))).leases

    clock.advance(15)
    renewed = (
        await stub.Renew(
            pb.RenewRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token, ttl_s=60)
        )
    ).lease
    assert renewed.expires_unix_ms == int(clock.time() * 1000) + 60_000
    assert renewed.fencing_token == lease.fencing_token

    release = pb.ReleaseRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token)
    assert (await stub.Release(release)).released is True
    assert (await stub.Release(release)).released is False  # idempotent
    assert free_by_gpu(await stub.Inventory(pb.InventoryRequest())) == {("n1", 0): 10_000, ("n1", 1): 6_000}


async def test_split_spreads_over_gpus_of_one_node(
    make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    broker = await start_broker(make_settings())
    reply = await broker.stub.Acquire(pb.AcquireRequest(holder="trainer", mb=12_000, allow_split=True))
    assert dict(reply.lease.mb_per_gpu) == {0: 7_500, 1: 4_500}
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await broker.stub.Acquire(pb.AcquireRequest(holder="trainer", mb=4_001, allow_split=True))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_acquire_is_idempotent_by_client_request_id(
    make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    broker = await start_broker(make_settings())
    stub = broker.stub
    request = pb.AcquireRequest(client_request_id="same", holder="w", mb=3_000)
    first, second = (await stub.Acquire(request)).lease, (await stub.Acquire(request)).lease
    assert (first.lease_id, first.fencing_token) == (second.lease_id, second.fencing_token)
    assert sum(g.leased_mb for g in (await stub.Inventory(pb.InventoryRequest())).gpus) == 3_000
    # Another holder's request id is its own.
    other = (await stub.Acquire(pb.AcquireRequest(client_request_id="same", holder="w2", mb=3_000))).lease
    assert other.lease_id != first.lease_id

    with pytest.raises(grpc.aio.AioRpcError) as changed:
        await stub.Acquire(pb.AcquireRequest(client_request_id="same", holder="w", mb=5_000))
    assert changed.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    await stub.Release(pb.ReleaseRequest(lease_id=first.lease_id, fencing_token=first.fencing_token))
    with pytest.raises(grpc.aio.AioRpcError) as replay:
        await stub.Acquire(request)
    assert replay.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "released or expired" in (replay.value.details() or "")


async def test_a_replayed_acquire_counts_its_ttl_from_the_replay(
    make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    """A holder whose Acquire reply was lost retries, and counts its deadline from the retry: the
    broker must not let the lease lapse earlier than that (it used to keep the first expiry)."""
    clock = FakeClock()
    broker = await start_broker(make_settings(lease_ttl_s=10.0), clock)
    request = pb.AcquireRequest(client_request_id="lost-reply", holder="w", mb=1_000)
    first = (await broker.stub.Acquire(request)).lease
    clock.advance(6)
    again = (await broker.stub.Acquire(request)).lease
    assert again.lease_id == first.lease_id and again.fencing_token == first.fencing_token
    assert again.expires_unix_ms == int(clock.time() * 1000) + 10_000
    listed = (await broker.stub.ListLeases(pb.ListLeasesRequest(holder="w"))).leases
    assert [lease.expires_unix_ms for lease in listed] == [again.expires_unix_ms]
    clock.advance(9)  # past the first expiry, within the replay's
    assert [
        lease.lease_id for lease in (await broker.stub.ListLeases(pb.ListLeasesRequest(holder="w"))).leases
    ] == [first.lease_id]


async def test_stale_fencing_token_is_refused(make_settings: MakeSettings, start_broker: StartBroker) -> None:
    broker = await start_broker(make_settings())
    stub = broker.stub
    lease = (await stub.Acquire(pb.AcquireRequest(holder="w", mb=1_000))).lease
    stale = lease.fencing_token + 1
    for call in (
        stub.Renew(pb.RenewRequest(lease_id=lease.lease_id, fencing_token=stale)),
        stub.Release(pb.ReleaseRequest(lease_id=lease.lease_id, fencing_token=stale)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "stale" in (refused.value.details() or "")
    listed = await stub.ListLeases(pb.ListLeasesRequest())
    assert [item.lease_id for item in listed.leases] == [lease.lease_id]  # untouched


async def test_overcommit_is_refused_with_free_memory_per_gpu(
    make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    broker = await start_broker(make_settings())
    await broker.stub.Acquire(pb.AcquireRequest(holder="w", mb=9_000))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await broker.stub.Acquire(pb.AcquireRequest(holder="w", mb=6_001))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = refused.value.details() or ""
    assert "6001 MB" in details
    assert "n1/0=1000 of 10000 MB" in details and "n1/1=6000 of 6000 MB" in details

    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await broker.stub.Acquire(pb.AcquireRequest(holder="w", node="nope", mb=1))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


async def test_expired_lease_is_reaped_and_its_memory_freed(
    make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    clock = FakeClock()
    broker = await start_broker(make_settings(), clock)
    stub = broker.stub
    watch = stub.Watch(pb.WatchRequest())
    await watch.initial_metadata()
    lease = (await stub.Acquire(pb.AcquireRequest(holder="w", mb=10_000, ttl_s=5))).lease
    assert (await watch.read()).kind == pb.WatchResponse.KIND_ACQUIRED

    clock.advance(4)  # still live
    assert (await stub.ListLeases(pb.ListLeasesRequest())).leases
    clock.advance(2)  # past the TTL: wakes the reaper
    expired = await watch.read()
    assert (expired.kind, expired.lease.lease_id) == (pb.WatchResponse.KIND_EXPIRED, lease.lease_id)
    assert free_by_gpu(await stub.Inventory(pb.InventoryRequest()))[("n1", 0)] == 10_000
    assert not (await stub.ListLeases(pb.ListLeasesRequest())).leases

    with pytest.raises(grpc.aio.AioRpcError) as late:
        await stub.Renew(pb.RenewRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token))
    assert late.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    released = await stub.Release(
        pb.ReleaseRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token)
    )
    assert released.released is False
    watch.cancel()


async def test_reregistering_a_node_keeps_live_leases(
    make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    broker = await start_broker(make_settings())
    stub = broker.stub
    lease = (await stub.Acquire(pb.AcquireRequest(holder="w", node="n1", gpus=[0], mb=2_000))).lease
    bigger = pb.RegisterNodeRequest(
        node="n1", gpus=[pb.Gpu(index=0, total_mb=20_000, reserve_mb=1_000, name="A", uuid="GPU-a")]
    )
    (gpu,) = (await stub.RegisterNode(bigger)).gpus
    assert (gpu.total_mb, gpu.reserve_mb, gpu.leased_mb, gpu.free_mb) == (20_000, 1_000, 2_000, 17_000)
    assert [item.lease_id for item in (await stub.ListLeases(pb.ListLeasesRequest())).leases] == [
        lease.lease_id
    ]

    dropping = pb.RegisterNodeRequest(node="n1", gpus=[pb.Gpu(index=1, total_mb=6_000)])
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.RegisterNode(dropping)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    await stub.RegisterNode(pb.RegisterNodeRequest(node="n2", gpus=[pb.Gpu(index=0, total_mb=4_000)]))
    on_n2 = (await stub.Acquire(pb.AcquireRequest(holder="w", node="n2", mb=3_000))).lease
    assert on_n2.node == "n2"
    assert [g.node for g in (await stub.Inventory(pb.InventoryRequest(node="n2"))).gpus] == ["n2"]
