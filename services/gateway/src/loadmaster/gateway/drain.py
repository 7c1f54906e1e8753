"""The SIGTERM drain of one table of work in flight: the dispatcher's calls, the generation
streams. Once it has begun, new work is refused (`shutting_down()`), and `wait` returns when
the table is empty or the time is up."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sized

from loadmaster.common.errors import UnavailableError

__all__ = ["Drain", "shutting_down"]


def shutting_down() -> UnavailableError:
    return UnavailableError("the gateway is shutting down; retry elsewhere")


class Drain:
    def __init__(self) -> None:
        self._empty: asyncio.Event | None = None

    @property
    def begun(self) -> bool:
        return self._empty is not None

    async def wait(self, in_flight: Sized, timeout_s: float) -> int:
        """Begin, and wait at most `timeout_s` (real time: the process is stopping) for
        `in_flight` to empty. Returns how many entries are still in it."""
        self._empty = asyncio.Event()
        if in_flight:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._empty.wait(), timeout_s)
        return len(in_flight)

    def left(self, in_flight: Sized) -> None:
        """An entry left `in_flight`: the wait ends once it is empty."""
        if self._empty is not None and not in_flight:
            self._empty.set()
