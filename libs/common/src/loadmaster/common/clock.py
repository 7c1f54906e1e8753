"""Injectable time. Core classes take a `Clock`; tests pass a `FakeClock` and advance it."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

__all__ = ["Clock", "FakeClock", "SystemClock"]


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a monotonic clock (deadlines, TTLs, cadence)."""

    def time(self) -> float:
        """Seconds since the UNIX epoch (wire timestamps)."""

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class FakeClock:
    """A clock that moves only when told to; `sleep` returns once `advance` passes its end."""

    def __init__(self, start: float = 1000.0, epoch: float = 1_700_000_000.0) -> None:
        self._now = start
        self._epoch_offset = epoch - start
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def monotonic(self) -> float:
        return self._now

    def time(self) -> float:
        return self._now + self._epoch_offset

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleepers.append((self._now + seconds, future))
        await future

    def advance(self, seconds: float) -> None:
        self._now += seconds
        due = sorted((entry for entry in self._sleepers if entry[0] <= self._now), key=lambda e: e[0])
        self._sleepers = [(t, f) for t, f in self._sleepers if t > self._now]
        for _, future in due:
            if not future.done():
                future.set_result(None)
