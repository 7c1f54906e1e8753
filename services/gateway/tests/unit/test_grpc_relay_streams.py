"""The relay's streaming side (`grpc_relay._streamed`) cancels the relayed call however its
handler ends early; a call left open upstream would hold the gateway's drain for its grace."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from loadmaster.gateway.frontends.grpc_relay import _streamed


class RelayedCall:
    """Stands in for a grpc.aio streaming call: endless responses until cancelled."""

    def __init__(self) -> None:
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[bytes]:
        n = 0
        while not self.cancelled:
            n += 1
            yield str(n).encode()
            await asyncio.sleep(0)

    def done(self) -> bool:
        return self.cancelled

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    async def initial_metadata(self) -> tuple[()]:
        return ()

    async def trailing_metadata(self) -> tuple[()]:
        return ()


class Context:
    async def send_initial_metadata(self, metadata: Any) -> None:
        raise AssertionError("nothing to send")


async def test_closed_at_a_yield_the_relayed_call_is_cancelled() -> None:
    call = RelayedCall()
    responses = _streamed(call, Context())  # type: ignore[arg-type]
    assert await anext(responses) == b"1"
    await responses.aclose()  # the handler was closed while the first response was being written
    assert call.cancelled


async def test_cancelled_while_waiting_the_relayed_call_is_cancelled() -> None:
    call = RelayedCall()
    waiting = asyncio.Event()

    async def slow() -> AsyncIterator[bytes]:
        waiting.set()
        await asyncio.sleep(60)
        yield b""

    call._responses = slow  # type: ignore[method-assign]
    reader = asyncio.create_task(anext(_streamed(call, Context())))  # type: ignore[arg-type]
    await waiting.wait()
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    assert call.cancelled
