"""Idle unloading: a model idle for its `keep_alive_s` is unloaded.

One background task per worker, started when the first model with a keep-alive becomes
READY. It sleeps until the next model could be due (`eviction.next_idle_deadline`) or
until `poke()` says something changed (a request finished, a pin flipped); which models
are due is decided by `eviction.idle_models`, the unloading is the pool's callback.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from loadmaster.common.clock import Clock
from loadmaster.model_pool._waiting import event_or_timeout
from loadmaster.model_pool.eviction import Resident, idle_models, next_idle_deadline

__all__ = ["KeepAlive"]

log = logging.getLogger(__name__)


class KeepAlive:
    def __init__(
        self,
        *,
        residents: Callable[[], list[Resident]],
        unload_idle: Callable[[str], Awaitable[None]],
        clock: Clock,
    ) -> None:
        self._residents = residents
        self._unload_idle = unload_idle
        self._clock = clock
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the loop (once; later calls do nothing)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="keep-alive")

    def poke(self) -> None:
        """Something that moves an idle deadline changed: look again now."""
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                self._wake.clear()
                residents = self._residents()
                now = self._clock.monotonic()
                due = idle_models(residents, now=now)
                if due:
                    await asyncio.gather(*(self._unload_idle(m) for m in due), return_exceptions=True)
                    continue
                deadline = next_idle_deadline(residents)
                await event_or_timeout(self._wake, self._clock, None if deadline is None else deadline - now)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("keep-alive step failed")
                await self._clock.sleep(1.0)
