"""`ScriptCoalescer`: script calls made while a round trip is in flight leave together.

Each broker operation is one EVALSHA. With many concurrent operations, sending each on its
own costs a pooled connection, a socket write and a read wakeup per call, on both sides:
measured, more CPU than the scripts themselves. The coalescer queues calls and sends the
queue as one redis-py `pipeline(transaction=False)`; while up to `max_in_flight` batches
travel, new calls queue behind them and leave as the next batch. A lone call still leaves
at once (on the next event-loop turn), so an idle broker adds no latency.

Semantics per call are those of `AsyncScript.__call__`: each script stays atomic on its own
(the pipeline is not a transaction and scripts never depend on each other); a NOSCRIPT reply
means the script did not run, so it is loaded and the calls that got it are sent again; a
connection error, or no reply within `timeout_s` (redis-py then closes the connection it was
reading), fails every call of the batch: their outcome is unknown, as for a single call, and
callers retry with the same client_request_id. A caller cancelled before its batch left is
dropped from it; one cancelled later is answered by nobody, its script runs anyway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["ScriptCoalescer"]


@dataclass(slots=True)
class _Call:
    script: AsyncScript
    keys: Sequence[str]
    args: Sequence[str | int]
    reply: asyncio.Future[Any]


class ScriptCoalescer:
    def __init__(self, client: aioredis.Redis, *, timeout_s: float, max_in_flight: int = 2) -> None:
        self._redis = client
        self._timeout_s = timeout_s
        self._max_in_flight = max_in_flight
        self._queue: list[_Call] = []
        self._senders: set[asyncio.Task[None]] = set()  # strong references to running tasks
        self._sending = 0  # senders that will still look at the queue

    async def call(self, script: AsyncScript, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        """The reply of `script(keys, args)`; raises what redis-py raises for that call."""
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append(_Call(script, keys, args, reply))
        if len(self._queue) == 1 and self._sending < self._max_in_flight:
            self._sending += 1
            sender = asyncio.create_task(self._send_queued())
            self._senders.add(sender)
            sender.add_done_callback(self._senders.discard)
        return await reply

    async def _send_queued(self) -> None:
        """Send the queue as one batch until it stays empty (runs as its own task, so a
        cancelled caller never cancels the batch of others)."""
        try:
            await self._send_batches()
        finally:
            self._sending -= 1  # before any other task runs: a call queued next starts a sender

    async def _send_batches(self) -> None:
        while self._queue:
            batch, self._queue = [c for c in self._queue if not c.reply.done()], []
            try:
                await self._send(batch)
            except Exception as error:  # every caller hears of it; nothing is left hanging
                for call in batch:
                    if not call.reply.done():
                        call.reply.set_exception(error)
            except BaseException:
                for call in batch:
                    call.reply.cancel()
                raise

    async def _send(self, batch: list[_Call]) -> None:
        if not batch:
            return
        replies = await self._round_trip(batch)
        missing = [n for n, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:  # Redis lost its script cache (restart, SCRIPT FLUSH): those calls did not run
            again = [batch[n] for n in missing]
            scripts = list({id(call.script): call.script for call in again}.values())
            for n, reply in zip(missing, await self._round_trip(again, load=scripts), strict=True):
                replies[n] = reply
        for call, reply in zip(batch, replies, strict=True):
            if call.reply.done():
                continue
            if isinstance(reply, Exception):
                call.reply.set_exception(reply)
            else:
                call.reply.set_result(reply)

    async def _round_trip(self, batch: list[_Call], *, load: Sequence[AsyncScript] = ()) -> list[Any]:
        """One pipeline: SCRIPT LOAD each of `load`, then the batch's calls; their replies
        (error replies as exception values)."""
        try:
            async with self._redis.pipeline(transaction=False) as pipe, asyncio.timeout(self._timeout_s):
                for script in load:
                    pipe.script_load(script.script)
                for call in batch:
                    pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
                replies = await pipe.execute(raise_on_error=False)  # a timeout closes the connection
        except TimeoutError as error:
            raise RedisTimeoutError(f"no reply from Redis within {self._timeout_s:g} s") from error
        return list(replies[len(load) :])
