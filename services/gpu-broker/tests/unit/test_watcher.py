"""A Watch stream's queue: order, overflow, and failure after the queued events."""

from __future__ import annotations

import pytest

from loadmaster.common.errors import UnavailableError
from loadmaster.gpu_broker.events import Watcher
from loadmaster.gpu_broker.leases import Lease, LeaseEvent, LeaseEventKind


def event(n: int) -> LeaseEvent:
    lease = Lease(
        lease_id=f"l{n}",
        holder="h",
        node="n",
        mb_per_gpu={0: 1},
        labels={},
        created_unix_ms=0,
        expires_unix_ms=1,
        fencing_token=n,
    )
    return LeaseEvent(kind=LeaseEventKind.ACQUIRED, lease=lease, timestamp_unix_ms=n)


async def test_events_arrive_in_order_then_the_error() -> None:
    watcher = Watcher(None, max_pending=10)
    for n in range(3):
        watcher.push(event(n))
    watcher.fail(UnavailableError("gone"))
    watcher.push(event(99))  # after a failure nothing more is queued
    assert [await anext(watcher) for _ in range(3)] == [event(0), event(1), event(2)]
    with pytest.raises(UnavailableError, match="gone"):
        await anext(watcher)


async def test_a_watcher_that_falls_behind_is_ended_not_skipped() -> None:
    watcher = Watcher(None, max_pending=2)
    for n in range(5):
        watcher.push(event(n))
    received = [await anext(watcher), await anext(watcher)]
    assert received == [event(0), event(1)]
    with pytest.raises(UnavailableError, match="fell 2 events behind"):
        await anext(watcher)
