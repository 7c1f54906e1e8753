"""Lease events fanned out to Watch streams.

The scripts publish every change on one Redis channel, so each broker replica sees
every event (its own, other replicas', and reaper expirations). `LeaseEventHub` holds
one subscription per process and copies each event to its `Watcher`s. A watcher never
silently skips an event: if it falls `max_pending` events behind, or the hub loses its
Redis subscription (events may have been missed), the watcher ends with
`UnavailableError` and the client re-lists and watches again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Iterator

from loadmaster.common.clock import Clock
from loadmaster.common.errors import LoadmasterError, UnavailableError
from loadmaster.common.retry import Backoff
from loadmaster.gpu_broker.leases import LeaseEvent
from loadmaster.gpu_broker.store import EventSubscription, RedisLeaseStore, decode_event

__all__ = ["LeaseEventHub", "Watcher"]

log = logging.getLogger(__name__)

# How long one read of the subscription waits before it is issued again. Nothing needs the
# listener to wake without a message: a closed connection fails the read at once, and each
# new read first pings Redis when the connection was quiet for its health-check interval.
# (It was 1 s: an idle broker woke every second for nothing.)
LISTEN_TIMEOUT_S = 30.0


class Watcher:
    """One Watch stream's queue: an async iterator of events that may end with an error."""

    def __init__(self, hub: LeaseEventHub | None, *, max_pending: int) -> None:
        self._hub = hub
        self._max_pending = max_pending
        self._pending: collections.deque[LeaseEvent] = collections.deque()
        self._wake = asyncio.Event()
        self._error: LoadmasterError | None = None

    def push(self, event: LeaseEvent) -> None:
        if self._error is not None:
            return
        if len(self._pending) >= self._max_pending:
            self.fail(UnavailableError(f"watch fell {self._max_pending} events behind; watch again"))
            return
        self._pending.append(event)
        self._wake.set()

    def fail(self, error: LoadmasterError) -> None:
        """End the stream with `error` once the events already queued are delivered."""
        if self._error is None:
            self._error = error
            self._wake.set()

    def close(self) -> None:
        if self._hub is not None:
            self._hub.forget(self)
            self._hub = None

    def __aiter__(self) -> Watcher:
        return self

    async def __anext__(self) -> LeaseEvent:
        while True:
            if self._pending:
                return self._pending.popleft()
            if self._error is not None:
                raise self._error
            self._wake.clear()
            await self._wake.wait()


class LeaseEventHub:
    def __init__(self, store: RedisLeaseStore, *, clock: Clock, max_pending: int = 10_000) -> None:
        self._store = store
        self._clock = clock
        self._max_pending = max_pending
        self._watchers: set[Watcher] = set()
        self._wakers: set[asyncio.Event] = set()
        self._subscription: EventSubscription | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def connected(self) -> bool:
        return self._subscription is not None

    async def start(self) -> None:
        """Subscribe once now (so Watch works as soon as the server serves), then keep it up."""
        await self._connect()
        self._task = asyncio.create_task(self._run(), name="gpu-broker-events")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._disconnect(UnavailableError("the broker is shutting down; watch another replica"))

    def watch(self) -> Watcher:
        """A new watcher of every event from now on. Close it when the stream ends."""
        if not self.connected:
            raise UnavailableError("the broker has no event stream from Redis right now; retry")
        watcher = Watcher(self, max_pending=self._max_pending)
        self._watchers.add(watcher)
        return watcher

    def forget(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)

    @contextlib.contextmanager
    def wakeups(self) -> Iterator[asyncio.Event]:
        """An event set on every lease event from any replica (memory may have been freed,
        or a waiter ahead was granted). Waiting acquires clear it, re-check, and wait on it."""
        wake = asyncio.Event()
        self._wakers.add(wake)
        try:
            yield wake
        finally:
            self._wakers.discard(wake)

    async def _connect(self) -> bool:
        try:
            self._subscription = await self._store.subscribe()
        except UnavailableError as error:
            log.warning("events: cannot subscribe: %s", error.message)
            return False
        except Exception:
            log.exception("events: subscribe failed")
            return False
        return True

    async def _disconnect(self, error: LoadmasterError) -> None:
        subscription, self._subscription = self._subscription, None
        for watcher in list(self._watchers):
            watcher.fail(error)
        self._watchers.clear()
        if subscription is not None:
            await subscription.close()

    async def _run(self) -> None:
        backoff = Backoff(first_s=0.1, max_s=5.0)
        while True:
            try:
                if self._subscription is None and not await self._connect():
                    await self._clock.sleep(backoff.next_s())
                    continue
                assert self._subscription is not None
                data = await self._subscription.next_message(timeout_s=LISTEN_TIMEOUT_S)
                backoff.reset()
                if data is not None:
                    event = decode_event(data) if self._watchers else None
                    if event is not None:
                        for watcher in list(self._watchers):
                            watcher.push(event)
                    for wake in self._wakers:
                        wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                if isinstance(error, UnavailableError):
                    log.warning("events: %s", error.message)
                else:
                    log.exception("events: listener step failed")
                await self._disconnect(
                    UnavailableError("the broker lost its Redis event stream; watch again")
                )
                await self._clock.sleep(backoff.next_s())
