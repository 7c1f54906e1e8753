"""The `Leases` stream over real gRPC and Redis: each op answered once under its op_id with the
unary call's semantics, failed ops as error results that leave the stream open, and ops that
run concurrently (a waiting Acquire does not hold up a Renew)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

from loadmaster.common.config import Settings
from loadmaster.common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
    error_for_code,
    from_grpc_error,
)
from loadmaster.v1 import gpu_broker_pb2 as pb

MakeSettings = Callable[..., Settings]
StartBroker = Callable[..., Awaitable[Any]]  # conftest.start_broker -> Broker(server, stub)


async def ask(call: Any, op: pb.LeaseOp) -> pb.LeaseOpResult:
    await call.write(op)
    result: pb.LeaseOpResult = await call.read()
    assert result.op_id == op.op_id
    return result


async def test_ops_keep_the_unary_semantics_and_errors(
    make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    broker = await start_broker(make_settings(lease_ttl_s=20.0))
    call = broker.stub.Leases()
    acquire = pb.AcquireRequest(client_request_id="r1", holder="w", mb=4_000, labels={"model": "m"})
    lease = (await ask(call, pb.LeaseOp(op_id=1, acquire=acquire))).acquire.lease
    assert (lease.node, dict(lease.mb_per_gpu), dict(lease.labels)) == ("n1", {1: 4_000}, {"model": "m"})
    replayed = await ask(call, pb.LeaseOp(op_id=2, acquire=acquire))  # idempotent by request id
    assert replayed.acquire.lease == lease

    renew = pb.RenewRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token, ttl_s=60)
    renewed = (await ask(call, pb.LeaseOp(op_id=3, renew=renew))).renew.lease
    assert renewed.expires_unix_ms - lease.expires_unix_ms >= 40_000

    stale = pb.ReleaseRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token + 1)
    failed = await ask(call, pb.LeaseOp(op_id=4, release=stale))
    assert failed.WhichOneof("result") == "error"
    assert isinstance(error_for_code(failed.error.code, failed.error.message), FailedPreconditionError)
    assert "stale" in failed.error.message
    with pytest.raises(grpc.aio.AioRpcError) as unary:  # the same error, as the unary call reports it
        await broker.stub.Release(stale)
    assert isinstance(from_grpc_error(unary.value), FailedPreconditionError)

    too_big = pb.AcquireRequest(client_request_id="r2", holder="w", mb=50_000)
    refused = await ask(call, pb.LeaseOp(op_id=5, acquire=too_big))
    assert isinstance(error_for_code(refused.error.code, refused.error.message), ResourceExhaustedError)
    empty = await ask(call, pb.LeaseOp(op_id=6))
    assert isinstance(error_for_code(empty.error.code, empty.error.message), InvalidArgumentError)

    release = pb.ReleaseRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token)
    assert (await ask(call, pb.LeaseOp(op_id=7, release=release))).release.released is True
    assert (await ask(call, pb.LeaseOp(op_id=8, release=release))).release.released is False
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    inventory = await broker.stub.Inventory(pb.InventoryRequest())
    assert sum(g.leased_mb for g in inventory.gpus) == 0


async def test_a_waiting_acquire_does_not_hold_up_later_ops(
    make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    broker = await start_broker(make_settings())
    call = broker.stub.Leases()
    full = pb.AcquireRequest(client_request_id="big", holder="a", mb=10_000)
    held = (await ask(call, pb.LeaseOp(op_id=1, acquire=full))).acquire.lease
    waiting = pb.AcquireRequest(client_request_id="next", holder="b", mb=10_000, wait_s=30)
    await call.write(pb.LeaseOp(op_id=2, acquire=waiting))
    renew = pb.RenewRequest(lease_id=held.lease_id, fencing_token=held.fencing_token)
    assert (await ask(call, pb.LeaseOp(op_id=3, renew=renew))).renew.lease.lease_id == held.lease_id
    release = pb.ReleaseRequest(lease_id=held.lease_id, fencing_token=held.fencing_token)
    assert (await ask(call, pb.LeaseOp(op_id=4, release=release))).release.released is True
    granted = await asyncio.wait_for(call.read(), 10)  # freed memory goes to the waiter
    assert granted.op_id == 2
    assert granted.acquire.lease.holder == "b" and dict(granted.acquire.lease.mb_per_gpu) == {0: 10_000}
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
