"""`LeaseKeeper`: every lease renewed on one timer, a lost lease reported alone."""

from __future__ import annotations

import asyncio

from loadmaster.common.clock import FakeClock
from loadmaster.common.errors import UnavailableError
from loadmaster.model_pool.leases import Lease, LeaseKeeper, LeaseLostError


class TickClient:
    """Renewals grouped by event-loop turn: each `renew` joins the current tick's list."""

    def __init__(self) -> None:
        self.ticks: list[list[str]] = []
        self.lost: set[str] = set()
        self.unreachable = False
        self._open = False

    async def renew(self, lease: Lease, *, ttl_s: float) -> Lease:
        if not self._open:
            self._open = True
            self.ticks.append([])
            asyncio.get_running_loop().call_soon(self._close_tick)
        self.ticks[-1].append(lease.lease_id)
        await asyncio.sleep(0)
        if self.unreachable:
            raise UnavailableError("gpu-broker unreachable")
        if lease.lease_id in self.lost:
            raise LeaseLostError(f"lease {lease.lease_id}: expired")
        return Lease(lease.lease_id, lease.fencing_token, lease.mb_per_gpu, expires_unix_ms=len(self.ticks))

    def _close_tick(self) -> None:
        self._open = False


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_all_leases_renew_together_and_only_the_lost_one_is_reported() -> None:
    clock, client, lost = FakeClock(), TickClient(), []
    keeper = LeaseKeeper(
        client, ttl_s=3.0, on_lost=lambda key, lease: lost.append((key, lease.lease_id)), clock=clock
    )  # type: ignore[arg-type]
    keeper.keep("a", Lease("lease-a", 1))
    await settle()  # the timer is set
    clock.advance(0.5)
    keeper.keep("b", Lease("lease-b", 1))  # between ticks: renewed at the next one with "a"
    keeper.keep("c", Lease("lease-c", 1))
    clock.advance(0.5)
    await settle()
    assert client.ticks == [["lease-a", "lease-b", "lease-c"]]
    assert keeper.lease("a") == Lease("lease-a", 1, expires_unix_ms=1)

    client.lost.add("lease-b")
    clock.advance(1.0)
    await settle()
    assert client.ticks[-1] == ["lease-a", "lease-b", "lease-c"]
    assert lost == [("b", "lease-b")]
    assert keeper.lease("b") is None and keeper.lease("a") is not None and keeper.lease("c") is not None

    clock.advance(1.0)
    await settle()
    assert client.ticks[-1] == ["lease-a", "lease-c"] and lost == [("b", "lease-b")]
    await keeper.close()


async def test_a_transient_failure_keeps_every_lease_for_the_next_tick() -> None:
    clock, client, lost = FakeClock(), TickClient(), []
    keeper = LeaseKeeper(client, ttl_s=3.0, on_lost=lambda key, lease: lost.append(key), clock=clock)  # type: ignore[arg-type]
    keeper.keep("a", Lease("lease-a", 1))
    keeper.keep("b", Lease("lease-b", 1))
    await settle()
    client.unreachable = True
    clock.advance(1.0)
    await settle()
    assert lost == [] and keeper.lease("a") == Lease("lease-a", 1)
    client.unreachable = False
    clock.advance(1.0)
    await settle()
    assert len(client.ticks) == 2 and keeper.lease("a") == Lease("lease-a", 1, expires_unix_ms=2)
    await keeper.close()


async def test_forgotten_leases_stop_renewing_and_the_timer_stops_with_the_last() -> None:
    clock, client = FakeClock(), TickClient()
    keeper = LeaseKeeper(client, ttl_s=3.0, on_lost=lambda key, lease: None, clock=clock)  # type: ignore[arg-type]
    keeper.keep("a", Lease("lease-a", 7))
    keeper.keep("b", Lease("lease-b", 1))
    await settle()
    clock.advance(1.0)
    await settle()
    assert keeper.forget("a") == Lease("lease-a", 7, expires_unix_ms=1)
    clock.advance(1.0)
    await settle()
    assert client.ticks == [["lease-a", "lease-b"], ["lease-b"]]
    keeper.forget("b")
    for _ in range(3):
        clock.advance(1.0)
        await settle()
    assert len(client.ticks) == 2
    keeper.keep("c", Lease("lease-c", 1))  # a new lease starts the timer again
    await settle()
    clock.advance(1.0)
    await settle()
    assert client.ticks[-1] == ["lease-c"]
    await keeper.close()
