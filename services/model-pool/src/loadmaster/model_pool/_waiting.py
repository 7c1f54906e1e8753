"""Wait for an event or the injected clock, whichever comes first (no polling)."""

from __future__ import annotations

import asyncio
from typing import Any

from loadmaster.common.clock import Clock

__all__ = ["event_or_timeout", "settle"]


async def event_or_timeout(event: asyncio.Event, clock: Clock, seconds: float | None) -> bool:
    """True when `event` was set, False when `seconds` (on `clock`; None = forever) passed first."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    waits: set[asyncio.Future[Any]] = {waiter}
    if seconds is not None:
        waits.add(asyncio.ensure_future(clock.sleep(max(0.0, seconds))))
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
    return event.is_set()


async def settle(task: asyncio.Future[Any]) -> None:
    """Wait for `task` without taking on its result or its error."""
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():
            raise
    except Exception:
        pass
