"""Renewals over real gRPC: the keeper's renewals travel as one RenewMany call, a lost lease
among several is reported alone (real broker on real Redis), and an older broker without
RenewMany is renewed one lease per call."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from loadmaster.client.lease_keeper import LeaseKeeper
from loadmaster.common.config import LeaseTiming
from loadmaster.common.errors import LoadmasterError, UnavailableError
from loadmaster.model_pool.leases import AsyncLeaseClient, Lease, LeaseLostError
from loadmaster.v1 import errors_pb2, gpu_broker_pb2, gpu_broker_pb2_grpc

if TYPE_CHECKING:
    from conftest import BrokerAt


class RecordingBroker(gpu_broker_pb2_grpc.GpuBrokerServiceServicer):
    """Answers renewals from `answers` (lease id -> error code, absent = renewed) and records
    each call; with `renew_many=False` it is a broker from before RenewMany."""

    def __init__(self, *, renew_many: bool, answers: dict[str, int]) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self._renew_many = renew_many
        self._answers = answers

    def _lease(self, request: gpu_broker_pb2.RenewRequest) -> gpu_broker_pb2.Lease:
        return gpu_broker_pb2.Lease(
            lease_id=request.lease_id, fencing_token=request.fencing_token, expires_unix_ms=42
        )

    async def RenewMany(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.calls.append(("RenewMany", [r.lease_id for r in request.renewals]))
        if not self._renew_many:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        results = []
        for renewal in request.renewals:
            code = self._answers.get(renewal.lease_id)
            if code is None:
                results.append(gpu_broker_pb2.RenewResult(lease=self._lease(renewal)))
            else:
                error = gpu_broker_pb2.LeaseOpError(code=code, message=f"lease {renewal.lease_id}: no")
                results.append(gpu_broker_pb2.RenewResult(error=error))
        return gpu_broker_pb2.RenewManyResponse(results=results)

    async def Renew(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.calls.append(("Renew", [request.lease_id]))
        if self._answers.get(request.lease_id) == errors_pb2.ERROR_CODE_FAILED_PRECONDITION:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"lease {request.lease_id} expired")
        return gpu_broker_pb2.RenewResponse(lease=self._lease(request))


@contextlib.asynccontextmanager
async def recording_broker(servicer: RecordingBroker) -> AsyncIterator[str]:
    server = grpc.aio.server()
    gpu_broker_pb2_grpc.add_GpuBrokerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def test_renewals_made_together_travel_in_one_call_each_with_its_own_answer() -> None:
    servicer = RecordingBroker(
        renew_many=True,
        answers={"gone": errors_pb2.ERROR_CODE_NOT_FOUND, "busy": errors_pb2.ERROR_CODE_UNAVAILABLE},
    )
    async with recording_broker(servicer) as address:
        client = AsyncLeaseClient(address, holder="w", node="local")
        outcomes = await asyncio.gather(
            *(client.renew(Lease(lease_id, 3), ttl_s=15) for lease_id in ("ok", "gone", "busy")),
            return_exceptions=True,
        )
        await client.close()
    assert servicer.calls == [("RenewMany", ["ok", "gone", "busy"])]
    renewed, gone, busy = outcomes
    assert isinstance(renewed, Lease)
    assert (renewed.lease_id, renewed.fencing_token, renewed.expires_unix_ms) == ("ok", 3, 42)
    assert isinstance(gone, LeaseLostError) and "gone" in gone.message
    assert isinstance(busy, UnavailableError) and not isinstance(busy, LeaseLostError)


async def test_a_broker_without_renew_many_is_renewed_one_lease_per_call() -> None:
    servicer = RecordingBroker(renew_many=False, answers={"old": errors_pb2.ERROR_CODE_FAILED_PRECONDITION})
    async with recording_broker(servicer) as address:
        client = AsyncLeaseClient(address, holder="w", node="local")
        first = await asyncio.gather(
            client.renew(Lease("a", 1), ttl_s=15),
            client.renew(Lease("old", 1), ttl_s=15),
            return_exceptions=True,
        )
        second = await client.renew(Lease("a", 1), ttl_s=15)
        await client.close()
    assert isinstance(first[0], Lease) and isinstance(first[1], LeaseLostError)
    assert (first[0].lease_id, first[0].expires_unix_ms) == ("a", 42)
    assert (second.lease_id, second.expires_unix_ms) == ("a", 42)
    assert sorted(servicer.calls) == sorted(
        [("RenewMany", ["a", "old"]), ("Renew", ["a"]), ("Renew", ["old"]), ("Renew", ["a"])]
    )


async def test_a_lost_lease_among_several_is_reported_alone_and_the_others_stay_renewed(
    real_broker: BrokerAt,
) -> None:
    async with real_broker() as (address, stub):
        client = AsyncLeaseClient(address, holder="w", node="local")
        lost: list[str] = []
        reported = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_lost(key: str, lease: Lease, error: LoadmasterError) -> None:  # on the keeper's thread
            lost.append(key)
            loop.call_soon_threadsafe(reported.set)

        keeper = LeaseKeeper(
            lambda: AsyncLeaseClient(address, holder="w", node="local"), on_lost=on_lost, reacquire=False
        )
        keeper.start()
        granted = {m: await client.acquire(mb=10, ttl_s=0.9, labels={"model": m}) for m in ("a", "b", "c")}
        for model, lease in granted.items():
            keeper.keep(model, lease, ttl_s=0.9)
        b = granted["b"]
        await stub.Release(gpu_broker_pb2.ReleaseRequest(lease_id=b.lease_id, fencing_token=b.fencing_token))
        await asyncio.wait_for(reported.wait(), 5.0)
        await asyncio.sleep(1.2)  # longer than the TTL: only renewals keep "a" and "c"
        leases = (await stub.ListLeases(gpu_broker_pb2.ListLeasesRequest(holder="w"))).leases
        await asyncio.to_thread(keeper.close)
        await client.close()
    assert lost == ["b"]
    assert keeper.lease("b") is None
    by_id = {lease.lease_id: lease for lease in leases}
    assert sorted(by_id) == sorted([granted["a"].lease_id, granted["c"].lease_id])
    for model in ("a", "c"):
        assert by_id[granted[model].lease_id].expires_unix_ms > granted[model].expires_unix_ms


async def test_a_lease_that_waited_for_memory_is_live_when_granted(real_broker: BrokerAt) -> None:
    """An Acquire that waited longer than the holder's deadline (counted from its send) comes
    back with a fresh base: renewed once, so the keeper does not find it lapsed at once."""
    ttl_s = 1.0
    async with real_broker(total_mb=1_000) as (address, _):
        client = AsyncLeaseClient(address, holder="w", node="local")
        try:
            first = await client.acquire(mb=1_000, ttl_s=30)
            waiting = asyncio.create_task(client.acquire(mb=1_000, ttl_s=ttl_s, wait_s=10))
            await asyncio.sleep(1.5)  # past the waiting one's deadline (0.8 of its TTL) from its send
            assert not waiting.done()
            await client.release(first)
            granted = await asyncio.wait_for(waiting, 10)
            left = granted.sent_monotonic + LeaseTiming.for_ttl(ttl_s).holder_deadline_s - time.monotonic()
            assert left > 0, "the lease came back already past its holder deadline"
            await client.release(granted)
        finally:
            await client.close()
