"""`ScriptCoalescer`: the broker's script ops, batched and pipelined on one Redis connection.

Each broker operation is one op of `scripts.OPS_SCRIPT`. The coalescer keeps one connection
of its own. The ops made during one turn of the event loop leave together at the end of it,
as one EVALSHA that runs them all (up to `MAX_OPS_PER_CALL` each), in one socket write; the
replies, which Redis sends in order, are matched to their callers as they arrive. Nothing
waits for an earlier call to come back, so Redis works on one batch while this process
prepares the next.

Callers that keep ops going back to back (a busy broker) fall into step: one reply wakes
them all, their next ops are made in the same turn, and with one call per turn Redis and
this process would only ever take turns, each idle while the other works. So a call leaves
early, before the turn ends, once it holds half the ops usually outstanding (queued or in
flight, a moving average taken at each write; at least `_MIN_EARLY` ops): the callers then
travel as two calls, and Redis runs one while this process works through the replies of
the other. (Measured with 8 clients on 2 cores: 5.9-6.3k -> 9.9k acquire + release pairs/s,
grant p50 0.69-0.72 -> 0.45 ms.) Until it has seen how many ops are outstanding, the
coalescer sends each turn's ops as one call.

Commands are packed and replies parsed by hiredis (the C parser redis-py uses), not by
redis-py's pipeline machinery: measured, that machinery (a pooled connection, a health
check, a timeout and a reply read per batch, packing in Python) was more than half of the
broker's CPU per op; one EVALSHA per op cost Redis ~11 us more per op than a batch. Over
gRPC, against a store that makes each call through redis-py's `Script` and reads events
through its `PubSub`, this saves 25-36 % of the broker's CPU per Acquire + Release pair
(bench/gpu_broker_store_compare.py; bench/results/HISTORY.md).

Semantics per op are those of a script call of its own: each op stays atomic and apart from
the others (an error in one is its own reply); a NOSCRIPT reply means nothing ran, so the
script is loaded and the batch sent once more; a connection error, or a call left without a
reply for `timeout_s` (the connection is then closed: later replies could no longer be
matched), fails every op in flight on the connection: their outcome is unknown, as for a
single call, and callers retry with the same client_request_id. The next op opens a new
connection. A caller cancelled before its op left is dropped; one cancelled later is
answered by nobody, its op runs anyway.

Redis behind Sentinel (docs/gpu-broker-internals.md, "Redis high availability"): the
connection comes from the pool, so a Sentinel pool's connection goes to the master the
Sentinels name at that moment. A READONLY reply (the server was demoted to a replica) closes
the connection like a connection error: the next op connects to the current master. With
`replica_ack_timeout_ms` > 0, every write that carries an op of `acked_ops` ends with
`WAIT 1 <timeout>`, and those ops are answered only once it returns: with their replies when
at least one replica holds the writes, with `ReplicaAckError` when none acknowledged in time.
Redis runs nothing after a WAIT on its connection until the WAIT returns, so ops made
meanwhile stay queued and leave together when it does: one WAIT is in flight at a time, and
without a replica each op waits at most about two WAIT timeouts (not one per write queued
behind the first).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    MasterDownError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["ReplicaAckError", "ScriptCoalescer", "new_reader", "open_stream", "pack_command", "reply_value"]

_READ_BYTES = 1 << 16
# A call leaves before its turn ends once it holds at least this many ops (and half the usual
# outstanding ones); a single op always waits for the turn's end, where others may join it.
_MIN_EARLY = 2
# Weight of each new sample in the moving average of outstanding ops.
_SMOOTHING = 0.1


class ReplicaAckError(RedisError):
    """No replica acknowledged an op's writes in time: the op ran on the master, but a
    failover could lose it."""


class _ReplyError(Exception):
    """An error reply as hiredis hands it over (turned into redis-py's class by `reply_value`)."""


# The error replies the store tells apart, by their first word, as redis-py's public exception
# classes (the connection-level ones subclass its ConnectionError: Redis is unavailable).
_ERRORS: dict[str, type[RedisError]] = {
    "NOSCRIPT": NoScriptError,
    "READONLY": ReadOnlyError,
    "LOADING": BusyLoadingError,
    "MASTERDOWN": MasterDownError,
    "NOAUTH": AuthenticationError,
    "WRONGPASS": AuthenticationError,
    "NOPERM": NoPermissionError,
    "OOM": OutOfMemoryError,
}


_NESTED_ERROR = re.compile(r"-(" + "|".join(_ERRORS) + r") ")


def _pack_in_python(args: tuple[Any, ...]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


# hiredis packs in C since 2.1; redis[hiredis] may bring an older one.
_pack: Callable[[tuple[Any, ...]], bytes] = getattr(hiredis, "pack_command", _pack_in_python)


def pack_command(*args: str | int) -> bytes:
    """One command in RESP."""
    return _pack(args)


def new_reader() -> hiredis.Reader:
    """A reply parser: text as str, error replies as values (see `reply_value`)."""
    return hiredis.Reader(encoding="utf-8", replyError=_ReplyError)


def reply_value(reply: Any) -> Any:
    """`reply`, or for an error reply the redis-py exception it stands for."""
    if not isinstance(reply, _ReplyError):
        return reply
    text = str(reply)
    code, _, message = text.partition(" ")
    error_class = _ERRORS.get(code)
    if error_class is None:
        # An error raised inside a script comes wrapped: "@user_script:1: -READONLY You can't
        # write against a read only replica." (the op's own reply, from OPS_SCRIPT's pcall).
        nested = _NESTED_ERROR.search(text)
        if nested is not None:
            return _ERRORS[nested.group(1)](text)
    return error_class(message) if error_class is not None else ResponseError(text)


async def open_stream(pool: aioredis.ConnectionPool) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A new connection to the pool's Redis, handshake done by redis-py (AUTH, SELECT, TLS as
    the URL says), as a raw stream pair that no pool or parser will touch again.

    The one use of redis-py's private internals: a connection's streams live in `_reader` and
    `_writer`, and one whose `_writer` is None counts as closed. The gpu-broker's pyproject
    pins redis-py to the versions this was checked against, and
    tests/unit/test_redis_internals.py fails when a version changes it."""
    connection = pool.make_connection()
    await connection.connect()
    reader, writer = getattr(connection, "_reader", None), getattr(connection, "_writer", None)
    if not isinstance(reader, asyncio.StreamReader) or not isinstance(writer, asyncio.StreamWriter):
        await connection.disconnect()
        raise RuntimeError("this redis-py version does not expose its connection's streams")
    connection._reader = connection._writer = None  # ours now: its __del__ would close them
    return reader, writer


@dataclass(slots=True)
class _Call:
    op: str
    now_ms: int
    args: Sequence[str | int]
    reply: asyncio.Future[Any]


@dataclass(slots=True)
class _Acks:
    """The replies of acknowledged ops, held until the WAIT after them returns."""

    held: list[tuple[_Call, Any]] = field(default_factory=list)


@dataclass(slots=True)
class _Sent:
    """One command on the wire: a batch of ops, or (`calls` empty) a SCRIPT LOAD or, with
    `wait`, the WAIT whose reply releases the replies `wait` holds."""

    calls: list[_Call]
    deadline: float
    retry: bool = False  # a batch sent again after NOSCRIPT
    acks: _Acks | None = None  # a batch: where its acknowledged ops' replies wait
    wait: _Acks | None = None  # a WAIT: the replies it releases


@dataclass(slots=True)
class _Connection:
    writer: asyncio.StreamWriter
    waiting: collections.deque[_Sent] = field(default_factory=collections.deque)
    reader_task: asyncio.Task[None] | None = None
    closed: bool = False
    waits: int = 0  # WAITs sent and not yet answered


class ScriptCoalescer:
    def __init__(
        self,
        pool: aioredis.ConnectionPool,
        *,
        script: str,
        keys: Sequence[str],
        prefix: str,
        channel: str,
        timeout_s: float,
        max_ops_per_call: int,
        replica_ack_timeout_ms: int = 0,
        acked_ops: frozenset[str] = frozenset(),
    ) -> None:
        self._pool = pool
        self._ack_ms = replica_ack_timeout_ms
        self._acked_ops = acked_ops if replica_ack_timeout_ms > 0 else frozenset()
        self._script = script
        self._sha = hashlib.sha1(script.encode()).hexdigest()
        self._keys = tuple(keys)
        self._prefix = prefix
        self._channel = channel
        self._timeout_s = timeout_s
        self._max_ops = max_ops_per_call
        self._queue: list[_Call] = []  # ops made since the last write
        self._reload: list[_Call] = []  # ops that got NOSCRIPT, to send again after a load
        self._connection: _Connection | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._flush_scheduled = False
        self._watchdog: asyncio.TimerHandle | None = None
        self._closed = False
        # Moving average of the ops outstanding (queued + in flight) at each write; it starts
        # high, so a turn's ops leave as one call until the real number is known.
        self._outstanding = float(2 * max_ops_per_call)

    async def call(self, op: str, now_ms: int, args: Sequence[str | int]) -> Any:
        """The reply of `op` (see `scripts.py`); raises what redis-py raises for a script call."""
        if self._closed:
            raise RedisConnectionError("the lease store was closed")
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        queue = self._queue
        queue.append(_Call(op, now_ms, args, reply))
        connection = self._connection
        if (
            len(queue) >= _MIN_EARLY
            and 2 * len(queue) >= self._outstanding
            and connection is not None
            and not connection.closed
        ):
            self._flush()  # half of the usual outstanding ops: Redis can start on these now
        else:
            self._schedule_flush()
        return await reply

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Write the queued ops (those whose caller still waits), connecting first if need be."""
        self._flush_scheduled = False
        connection = self._connection
        if self._closed:
            return
        if connection is None or connection.closed:
            if self._connecting is None:
                self._connecting = asyncio.get_running_loop().create_task(self._connect())
            return  # the connection task flushes once connected
        if connection.waits:
            return  # Redis runs nothing after a WAIT until it returns: the reply flushes
        deadline = asyncio.get_running_loop().time() + self._timeout_s + self._ack_ms / 1000
        sent: list[_Sent] = []
        commands: list[bytes] = []
        if self._reload:
            again, self._reload = [c for c in self._reload if not c.reply.done()], []
            if again:
                sent.append(_Sent([], deadline))
                commands.append(pack_command("SCRIPT", "LOAD", self._script))
                self._batch(again, deadline, sent, commands, retry=True)
        self._batch([c for c in self._queue if not c.reply.done()], deadline, sent, commands, retry=False)
        self._queue = []
        if not commands:
            return
        if self._acked_ops:
            self._add_wait(sent, commands, deadline)
        try:
            connection.writer.write(b"".join(commands))
        except Exception as error:  # a transport closing under us: these ops did not leave
            connection.waiting.extend(sent)
            self._close(connection, RedisConnectionError(f"Redis connection failed: {error!r}"))
            return
        connection.waiting.extend(sent)
        connection.waits += sum(1 for batch in sent if batch.wait is not None)
        in_flight = sum(len(batch.calls) for batch in connection.waiting)  # a few calls at most
        self._outstanding += (in_flight - self._outstanding) * _SMOOTHING
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().call_at(deadline, self._check_deadlines)

    def _batch(
        self, calls: list[_Call], deadline: float, sent: list[_Sent], commands: list[bytes], *, retry: bool
    ) -> None:
        for start in range(0, len(calls), self._max_ops):
            chunk = calls[start : start + self._max_ops]
            argv: list[str | int] = [self._prefix, chunk[0].now_ms, self._channel]
            for call in chunk:
                argv += (call.op, call.now_ms, len(call.args), *call.args)
            commands.append(pack_command("EVALSHA", self._sha, len(self._keys), *self._keys, *argv))
            sent.append(_Sent(chunk, deadline, retry))

    def _add_wait(self, sent: list[_Sent], commands: list[bytes], deadline: float) -> None:
        """End the write with a WAIT when it carries an acknowledged op (one WAIT covers every
        earlier write of the connection)."""
        acks = _Acks()
        for batch in sent:
            if any(call.op in self._acked_ops for call in batch.calls):
                batch.acks = acks
        if any(batch.acks is acks for batch in sent):
            sent.append(_Sent([], deadline, wait=acks))
            commands.append(pack_command("WAIT", 1, self._ack_ms))

    def _deliver(self, connection: _Connection, sent: _Sent, raw: Any) -> None:
        reply = reply_value(raw)
        if sent.wait is not None:
            connection.waits -= 1
            self._release(sent.wait, reply)
            if self._queue or self._reload:
                self._schedule_flush()
            return
        if not sent.calls:  # a SCRIPT LOAD: a failure shows in the NOSCRIPT of the batch after it
            return
        if isinstance(reply, NoScriptError) and not sent.retry:  # Redis lost its scripts (restart, FLUSH)
            self._reload += sent.calls  # nothing ran: load, then send them again
            self._schedule_flush()
            return
        if isinstance(reply, Exception):
            for call in sent.calls:
                if not call.reply.done():
                    call.reply.set_exception(reply)
            if isinstance(reply, ReadOnlyError):
                self._demoted(connection)
            return
        demoted = False
        for call, value in zip(sent.calls, reply, strict=True):
            if call.reply.done():
                continue
            if isinstance(value, _ReplyError):  # that op raised; the others ran
                error = reply_value(value)
                demoted = demoted or isinstance(error, ReadOnlyError)
                call.reply.set_exception(error)
            elif sent.acks is not None and call.op in self._acked_ops:
                sent.acks.held.append((call, value))
            else:
                call.reply.set_result(value)
        if demoted:
            self._demoted(connection)

    def _release(self, acks: _Acks, reply: Any) -> None:
        """Answer the held ops with the WAIT's outcome (the number of replicas that hold
        their writes, or an error)."""
        failure: BaseException | None = None
        if isinstance(reply, Exception):
            failure = reply
        elif not isinstance(reply, int) or reply < 1:
            failure = ReplicaAckError(f"no replica acknowledged the write within {self._ack_ms} ms")
        held, acks.held = acks.held, []
        for call, value in held:
            if call.reply.done():
                continue
            if failure is None:
                call.reply.set_result(value)
            else:
                call.reply.set_exception(failure)

    def _demoted(self, connection: _Connection) -> None:
        """A READONLY reply: this server is a replica now (a failover). Drop the connection,
        so the next op connects to the master the pool resolves then."""
        self._close(connection, RedisConnectionError("Redis answered READONLY: it is no longer the master"))

    async def _read_replies(self, connection: _Connection, reader: asyncio.StreamReader) -> None:
        parser = new_reader()
        error: BaseException = RedisConnectionError("Redis closed the connection")
        try:
            while data := await reader.read(_READ_BYTES):
                parser.feed(data)
                while (reply := parser.gets()) is not False:
                    self._deliver(connection, connection.waiting.popleft(), reply)
                    if connection.closed:  # a READONLY reply: the rest is not read
                        return
        # IndexError, ValueError: replies that match no command, or not its number of ops
        except (OSError, hiredis.ProtocolError, IndexError, ValueError, TypeError) as failure:
            error = RedisConnectionError(f"Redis connection failed: {failure!r}")
        finally:
            self._close(connection, error)

    async def _connect(self) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                reader, writer = await open_stream(self._pool)
        except Exception as error:
            failure = (
                RedisTimeoutError("no connection to Redis in time")
                if isinstance(error, TimeoutError)
                else error
            )
            queued, self._queue = self._queue + self._reload, []
            self._reload = []
            for call in queued:
                if not call.reply.done():
                    call.reply.set_exception(failure)
            return
        finally:
            self._connecting = None
        connection = _Connection(writer)
        connection.reader_task = asyncio.get_running_loop().create_task(
            self._read_replies(connection, reader)
        )
        self._connection = connection
        self._flush()

    def _close(self, connection: _Connection, error: BaseException) -> None:
        """Fail every op in flight on `connection` with `error` and drop it (idempotent)."""
        if connection.closed:
            return
        connection.closed = True
        connection.writer.close()
        if connection.reader_task is not None and asyncio.current_task() is not connection.reader_task:
            connection.reader_task.cancel()
        while connection.waiting:
            sent = connection.waiting.popleft()
            held = sent.wait.held if sent.wait is not None else []
            for call in [*sent.calls, *(call for call, _ in held)]:
                if not call.reply.done():
                    call.reply.set_exception(error)

    def _check_deadlines(self) -> None:
        """Close a connection whose oldest command is past its deadline; re-arm for the next one."""
        self._watchdog = None
        connection = self._connection
        if connection is None or connection.closed or not connection.waiting:
            return
        loop = asyncio.get_running_loop()
        oldest = connection.waiting[0]
        if oldest.deadline <= loop.time():
            self._close(connection, RedisTimeoutError(f"no reply from Redis within {self._timeout_s:g} s"))
            return
        self._watchdog = loop.call_at(oldest.deadline, self._check_deadlines)

    async def close(self) -> None:
        """Fail the ops not yet answered and close the connection."""
        self._closed = True
        closing = RedisConnectionError("the lease store was closed")
        queued, self._queue, self._reload = self._queue + self._reload, [], []
        for call in queued:
            if not call.reply.done():
                call.reply.set_exception(closing)
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._connecting is not None:
            self._connecting.cancel()
        connection, self._connection = self._connection, None
        if connection is not None:
            self._close(connection, closing)
            if connection.reader_task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await connection.reader_task
