"""Injected time: FakeClock moves only when told, and wakes sleepers when their end passes."""

from __future__ import annotations

import asyncio
import inspect
import time

import pytest

from loadmaster.common.clock import Clock, FakeClock, SystemClock


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_fake_clock_reads_its_start_and_epoch_and_moves_only_on_advance() -> None:
    clock = FakeClock(start=50.0, epoch=1_000.0)
    assert clock.monotonic() == 50.0 and clock.time() == 1_000.0
    assert clock.monotonic() == 50.0  # no drift
    clock.advance(2.5)
    assert clock.monotonic() == 52.5 and clock.time() == 1_002.5


async def test_sleep_returns_only_once_advance_passes_its_end() -> None:
    clock = FakeClock()
    sleeper = asyncio.create_task(clock.sleep(1.0))
    await settle()
    assert not sleeper.done()
    clock.advance(0.6)
    await settle()
    assert not sleeper.done()
    clock.advance(0.4)  # exactly at the end
    await settle()
    assert sleeper.done()
    await sleeper


@pytest.mark.parametrize("seconds", [0, -1.0])
async def test_non_positive_sleeps_return_without_advancing(seconds: float) -> None:
    clock = FakeClock()
    await asyncio.wait_for(clock.sleep(seconds), timeout=1.0)
    assert clock.monotonic() == 1000.0


async def test_one_advance_wakes_every_due_sleeper_and_no_other() -> None:
    clock = FakeClock()
    short = asyncio.create_task(clock.sleep(1.0))
    medium = asyncio.create_task(clock.sleep(2.0))
    long = asyncio.create_task(clock.sleep(10.0))
    await settle()
    clock.advance(5.0)
    await settle()
    assert short.done() and medium.done() and not long.done()
    clock.advance(5.0)
    await settle()
    assert long.done()


async def test_a_cancelled_sleeper_does_not_break_advance() -> None:
    clock = FakeClock()
    cancelled = asyncio.create_task(clock.sleep(1.0))
    other = asyncio.create_task(clock.sleep(1.0))
    await settle()
    cancelled.cancel()
    await settle()
    clock.advance(1.0)
    await settle()
    assert cancelled.cancelled() and other.done() and other.exception() is None


async def test_one_advance_wakes_sleepers_in_deadline_order() -> None:
    clock = FakeClock()
    woke: list[str] = []

    async def sleep(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append(name)

    tasks = [asyncio.create_task(sleep("late", 5.0)), asyncio.create_task(sleep("early", 1.0))]
    await settle()
    clock.advance(10.0)
    await asyncio.gather(*tasks)
    assert woke == ["early", "late"]


async def test_system_clock_follows_real_time() -> None:
    clock: Clock = SystemClock()
    start = clock.monotonic()
    assert abs(clock.time() - time.time()) < 1.0
    await clock.sleep(0.01)
    assert clock.monotonic() - start >= 0.009


def test_both_clocks_satisfy_the_protocol() -> None:
    for clock in (SystemClock(), FakeClock()):
        assert callable(clock.monotonic) and callable(clock.time) and inspect.iscoroutinefunction(clock.sleep)
