from __future__ import annotations

import asyncio

from loadmaster.metrics.subscriptions import Subscriptions
from loadmaster.metrics.windows import Sample, label_set, observations_of


def sample(name: str, value: float, **labels: str) -> Sample:
    return Sample(name, value, label_set(labels, service="gateway"))


async def test_watch_receives_matching_samples_in_order() -> None:
    subscriptions = Subscriptions()
    with subscriptions.watch(names=["a"], labels=label_set({"model": "m"})) as watch:
        assert len(subscriptions) == 1
        subscriptions.publish(
            observations_of([sample("a", 1.0, model="m"), sample("b", 2.0, model="m"), sample("a", 3.0)])
        )
        subscriptions.publish(observations_of([sample("a", 4.0, model="m", code="ok")]))
        batch = await asyncio.wait_for(anext(aiter(watch)), 1.0)
    assert [s.value for s in batch] == [1.0, 4.0]
    assert len(subscriptions) == 0


async def test_empty_names_match_every_name() -> None:
    subscriptions = Subscriptions()
    with subscriptions.watch() as watch:
        subscriptions.publish(observations_of([sample("a", 1.0), sample("b", 2.0)]))
        batch = await asyncio.wait_for(anext(aiter(watch)), 1.0)
    assert [s.name for s in batch] == ["a", "b"]


async def test_slow_watcher_drops_oldest_and_publish_never_waits() -> None:
    subscriptions = Subscriptions(max_pending=10)
    with subscriptions.watch() as slow, subscriptions.watch(names=["other"]) as idle:
        for start in range(0, 100, 5):
            subscriptions.publish(observations_of([sample("a", float(v)) for v in range(start, start + 5)]))
        batch = await asyncio.wait_for(anext(aiter(slow)), 1.0)
    assert [s.value for s in batch] == [float(v) for v in range(90, 100)]
    assert slow.dropped == 90
    assert idle.dropped == 0
    assert subscriptions.dropped == 90


async def test_close_ends_iteration_after_pending() -> None:
    subscriptions = Subscriptions()
    with subscriptions.watch() as watch:
        received: list[float] = []

        async def read() -> None:
            async for batch in watch:
                received.extend(s.value for s in batch)

        reader = asyncio.create_task(read())
        subscriptions.publish(observations_of([sample("a", 1.0)]))
        await asyncio.sleep(0)
        subscriptions.publish(observations_of([sample("a", 2.0)]))
        subscriptions.close_all()
        await asyncio.wait_for(reader, 1.0)
    assert received == [1.0, 2.0]
    with subscriptions.watch() as late:
        assert late.closed
