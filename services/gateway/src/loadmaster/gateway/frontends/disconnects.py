"""A client that leaves before its answer is ready: how every HTTP front end notices it and
cancels the work it asked for (KServe v2, OpenAI, Ollama, Anthropic, images, embeddings)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from loadmaster.common.errors import CancelledError_

__all__ = ["ClientGone", "unless_client_leaves", "until_disconnected"]

T = TypeVar("T")


class ClientGone(CancelledError_):
    """The client disconnected before its reply was ready (a `cancelled` error: 499, never seen)."""

    def __init__(self) -> None:
        super().__init__("the client went away")


async def until_disconnected(request: Request) -> None:
    """Return when the client goes away (after its body was read, that is all `receive` says)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or `ClientGone` once the client has left and `work` is cancelled.

    The work is waited for after its cancellation, so what it opened (a dispatcher call, a
    generation's iterator) is closed before the handler answers; and `Task.cancel` only asks,
    so until then the task is neither cancelled nor has a result."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if not task.done():
        await asyncio.wait({task})
    if task.cancelled():
        raise ClientGone()
    return task.result()
