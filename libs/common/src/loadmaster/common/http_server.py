"""A quieter main loop for uvicorn run as one task of a service's event loop (the gateway's
HTTP front end, the metrics HTTP server).

    await server.startup(sockets=...)                     # a uvicorn.Server
    task = asyncio.create_task(main_loop(server, stop))   # instead of server.main_loop()
    stop.set(); await task; await server.shutdown()       # returns at once, not at a tick

uvicorn's own loop wakes ten times a second to refresh the Date header (which changes
once a second) and to check `should_exit`; with two such servers that showed up in the
idle suite's CPU. This one ticks once a second and ends when `stop` is set.

uvicorn is imported for type checking only: services without an HTTP server do not
install it. `on_tick` is undocumented uvicorn: the services that serve HTTP pin uvicorn, and
services/metrics/tests/unit/test_uvicorn_internals.py checks what this loop assumes of it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import uvicorn

__all__ = ["main_loop"]

_TICKS_PER_S = 10  # uvicorn's on_tick refreshes the Date header when counter % 10 == 0
_COUNTER_WRAP = 864_000  # as uvicorn's main_loop


async def main_loop(server: uvicorn.Server, stop: asyncio.Event) -> None:
    counter = 0
    while not stop.is_set() and not await server.on_tick(counter):
        counter = (counter + _TICKS_PER_S) % _COUNTER_WRAP
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
