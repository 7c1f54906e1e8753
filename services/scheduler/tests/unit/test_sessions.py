"""The live layer without sockets: outboxes, the stream pump, the deadline timer, the hub."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from loadmaster.common.clock import FakeClock, SystemClock
from loadmaster.scheduler.core import CoreConfig
from loadmaster.scheduler.domain import (
    Grant,
    PlacedWorker,
    Placement,
    Reject,
    RemoteService,
    RequestInfo,
    SlotState,
    SlotStatus,
    Submission,
    WorkerHello,
)
from loadmaster.scheduler.sessions import DeadlineTimer, Outbox, SchedulerHub, pump
from loadmaster.v1 import errors_pb2


async def test_outbox_hands_over_everything_pending_at_once() -> None:
    box: Outbox[int] = Outbox()
    box.put(1)
    box.put(2)
    assert await box.take_all() == [1, 2]
    waiter = asyncio.create_task(box.take_all())
    await asyncio.sleep(0)
    assert not waiter.done()
    box.put(3)
    assert await asyncio.wait_for(waiter, 1) == [3]
    box.put(4)
    box.close()
    box.put(5)  # after close: dropped
    assert await box.take_all() == [4]
    assert await box.take_all() == []


async def _messages(items: list[str], gate: asyncio.Event | None = None) -> AsyncIterator[str]:
    for item in items:
        yield item
    if gate is not None:
        await gate.wait()


async def test_pump_feeds_the_handler_and_flushes_when_inbound_ends() -> None:
    box: Outbox[str] = Outbox()
    seen: list[str] = []

    def handle(message: str) -> None:
        seen.append(message)
        box.put(message.upper())

    batches = [batch async for batch in pump(_messages(["a", "b"]), handle, box)]
    assert seen == ["a", "b"]
    assert [item for batch in batches for item in batch] == ["A", "B"]


async def test_pump_ends_when_the_outbox_is_closed_elsewhere() -> None:
    box: Outbox[str] = Outbox()
    gate = asyncio.Event()

    async def consume() -> list[list[str]]:
        return [batch async for batch in pump(_messages([], gate), lambda m: None, box)]

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.01)
    box.close()
    assert await asyncio.wait_for(task, 1) == []


async def test_pump_raises_what_the_handler_raised() -> None:
    def handle(message: str) -> None:
        raise ValueError(message)

    with pytest.raises(ValueError, match="boom"):
        async for _ in pump(_messages(["boom"]), handle, Outbox()):
            pass


async def test_deadline_timer_fires_once_at_the_earliest_deadline() -> None:
    clock = FakeClock()
    fired: list[float] = []
    timer = DeadlineTimer(clock, lambda: fired.append(time.monotonic()))
    start = time.monotonic()
    timer.arm(clock.monotonic() + 0.05)
    timer.arm(clock.monotonic() + 0.01)  # earlier: re-armed
    timer.arm(clock.monotonic() + 0.03)  # later: the earlier one is kept
    assert timer.deadline == clock.monotonic() + 0.01
    await asyncio.sleep(0.08)
    assert len(fired) == 1 and 0.005 <= fired[0] - start < 0.05
    assert timer.deadline is None
    timer.arm(clock.monotonic() + 0.01)
    timer.arm(None)
    await asyncio.sleep(0.03)
    assert len(fired) == 1


async def test_hub_routes_outcomes_and_expires_on_time_without_polling() -> None:
    hub = SchedulerHub(CoreConfig(request_ttl_ms=5000.0, max_inflight=lambda m: 1), clock=SystemClock())
    worker = hub.connect_worker(WorkerHello("w1", "tcp://w1", repository=("m",)))
    assert len(worker.outbox) == 0  # nothing waits yet: no load commanded
    hub.report(worker, [SlotStatus("m", SlotState.READY, generation=3)])
    gateway = hub.open_session("g1")
    hub.submit(
        gateway, Submission(enqueues=[RequestInfo("busy", "m"), RequestInfo("late", "m", timeout_ms=30)])
    )
    [grant] = await gateway.outbox.take_all()
    assert isinstance(grant, Grant) and grant.generation == 3
    started = time.monotonic()
    [reject] = await asyncio.wait_for(gateway.outbox.take_all(), 1)
    waited_ms = (time.monotonic() - started) * 1000
    assert isinstance(reject, Reject) and reject.error_code == errors_pb2.ERROR_CODE_EXPIRED
    assert 20 <= waited_ms < 200
    hub.close_session(gateway)
    hub.disconnect_worker(worker)
    await hub.stop()
    assert gateway.outbox.closed and worker.outbox.closed


async def test_the_hub_tells_each_worker_what_tenants_got_on_the_others() -> None:
    hub = SchedulerHub(CoreConfig(request_ttl_ms=5000.0, max_inflight=lambda m: 1), clock=SystemClock())
    first = hub.connect_worker(WorkerHello("w1", "tcp://w1", repository=("chat",)))
    second = hub.connect_worker(WorkerHello("w2", "tcp://w2", repository=("chat",)))
    hub.tenant_service(first, {"chat": {"a": 120.0}})
    hub.tenant_service(second, {"chat": {"b": 30.0}})
    [to_first] = await first.outbox.take_all()
    assert to_first == RemoteService({"chat": {"b": 30.0}})
    hub.disconnect_worker(second)  # what it gave no longer counts
    [after] = await first.outbox.take_all()
    assert after == RemoteService({"chat": {}})
    await hub.stop()


async def test_gateways_hear_where_generative_models_are_served_and_when_that_changes() -> None:
    hub = SchedulerHub(CoreConfig(request_ttl_ms=5000.0, max_inflight=lambda m: 1), clock=SystemClock())
    first = hub.connect_worker(WorkerHello("w1", "tcp://w1", repository=("chat", "m")))
    hub.report(first, [SlotStatus("chat", SlotState.READY, generation=2, backend="transformers")])
    gateway = hub.open_session("g1")
    [told] = await gateway.outbox.take_all()  # what it missed before it came
    assert told == Placement("chat", (PlacedWorker("w1", "tcp://w1", 2),))
    second = hub.connect_worker(WorkerHello("w2", "tcp://w2", repository=("chat",)))
    hub.report(second, [SlotStatus("chat", SlotState.LOADING, backend="transformers")])
    hub.report(
        first,
        [
            SlotStatus("chat", SlotState.READY, generation=2, backend="transformers"),
            SlotStatus("m", SlotState.READY, generation=1, backend="torch"),
        ],
    )  # tensors: not told
    assert len(gateway.outbox) == 0  # nothing changed for generations
    hub.report(second, [SlotStatus("chat", SlotState.READY, generation=5, backend="transformers")])
    [both] = await gateway.outbox.take_all()
    assert both == Placement("chat", (PlacedWorker("w1", "tcp://w1", 2), PlacedWorker("w2", "tcp://w2", 5)))
    hub.disconnect_worker(first)
    hub.disconnect_worker(second)
    told = await gateway.outbox.take_all()
    assert told[-1] == Placement("chat", ())  # served nowhere: generations go through the queue again
    await hub.stop()
