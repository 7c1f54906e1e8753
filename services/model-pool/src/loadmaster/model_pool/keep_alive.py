"""Idle unloading: a model idle for its `keep_alive_s` is unloaded.

One background task per worker, started when the first model with a keep-alive becomes
READY. It sleeps until the next model could be due (`eviction.next_idle_deadline`) or
until `poke()` says something changed (a request finished, a pin flipped); which models
are due is decided by `eviction.idle_models`, the unloading is the pool's callback.

A model's keep-alive (`keep_alive_for`, read at each load) is the first set of: its entry in
`models.known`, its config.yaml's `keep_alive_s`, its category's default
(`models.category_keep_alive_s`: llm 300 s, vision 60 s, diffusion 900 s, other never), and
`models.defaults.keep_alive_s`. None: never unloaded for idleness.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from loadmaster.common.clock import Clock
from loadmaster.common.config import ModelsSettings
from loadmaster.model_pool._waiting import event_or_timeout
from loadmaster.model_pool.eviction import Resident, idle_models, next_idle_deadline
from loadmaster.model_pool.repository import ModelSpec

__all__ = ["KeepAlive", "keep_alive_for"]

log = logging.getLogger(__name__)


def keep_alive_for(models: ModelsSettings, spec: ModelSpec) -> float | None:
    """Idle seconds before `spec`'s model is unloaded (None: never), most specific setting first."""
    entry = models.known.get(spec.model_id)
    if entry is not None and entry.keep_alive_s is not None:
        return entry.keep_alive_s
    if spec.config.keep_alive_s is not None:
        return spec.config.keep_alive_s
    by_category: float | None = getattr(models.category_keep_alive_s, spec.category)
    if by_category is not None:
        return by_category
    return models.defaults.keep_alive_s


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
