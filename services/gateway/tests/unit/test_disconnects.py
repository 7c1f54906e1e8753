"""`unless_client_leaves`: the work's result, or `ClientGone` once the client left and the work
was cancelled and had unwound (the copies it replaced read the task's result right after
`cancel()`, which only asks: `InvalidStateError`, answered as an internal error)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from loadmaster.gateway.frontends.disconnects import ClientGone, unless_client_leaves


class Request:
    """A starlette request's `receive`: the body was read; `leave()` disconnects."""

    def __init__(self) -> None:
        self._left = asyncio.Event()

    def leave(self) -> None:
        self._left.set()

    async def receive(self) -> dict[str, Any]:
        await self._left.wait()
        return {"type": "http.disconnect"}


async def test_the_work_s_result_when_it_finishes_first() -> None:
    async def work() -> str:
        return "done"

    assert await unless_client_leaves(Request(), work()) == "done"  # type: ignore[arg-type]


async def test_a_client_that_leaves_cancels_the_work_and_waits_for_it_to_unwind() -> None:
    request = Request()
    unwound = asyncio.Event()

    async def work() -> str:
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.01)  # closing what it opened takes a moment
            unwound.set()
        return "never"

    answer = asyncio.ensure_future(unless_client_leaves(request, work()))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    request.leave()
    with pytest.raises(ClientGone):
        await answer
    assert unwound.is_set()


async def test_a_failure_of_the_work_is_raised_as_it_is() -> None:
    async def work() -> str:
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        await unless_client_leaves(Request(), work())  # type: ignore[arg-type]
