"""Helpers for async streams that a service ends when it stops (Report, Watch, ModelStreamInfer)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

__all__ = ["until_set"]

_T = TypeVar("_T")


async def until_set(event: asyncio.Event, items: AsyncIterator[_T]) -> AsyncIterator[_T]:
    """The items of `items` until they end or `event` is set, whichever comes first."""
    stopped = asyncio.ensure_future(event.wait())
    try:
        while not event.is_set():
            item = asyncio.ensure_future(anext(items))
            await asyncio.wait((item, stopped), return_when=asyncio.FIRST_COMPLETED)
            if not item.done():
                item.cancel()
                return
            try:
                value = item.result()
            except StopAsyncIteration:
                return
            yield value
    finally:
        stopped.cancel()
