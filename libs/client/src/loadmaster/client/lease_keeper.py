"""Keeps GPU leases alive from a thread of its own, and says when one may no longer be used.

    keeper = LeaseKeeper(lambda: AsyncLeaseClient(address, holder=...), on_lost=stop_using)
    keeper.start()                      # its thread, its event loop, its own gRPC channel
    keeper.keep("policy", lease, ttl_s=15.0)
    keeper.live("policy")               # True only while the lease is certainly ours
    keeper.forget("policy")             # -> the lease with its latest token, for release
    keeper.close()

Renewals never share a thread with request decoding or inference: a holder whose own event
loop is blocked (a huge request, a slow engine) still renews on time.

The timing contract is `loadmaster.common.config.LeaseTiming` (see docs/leases.md): each lease
is renewed every `renew_every_s`; it is `live` until `holder_deadline_s` after the SEND of the
last Acquire/Renew the broker granted, which is before the broker could re-grant the memory.
When that deadline passes without a successful renewal (broker unreachable, renewals too
late) the lease is dropped and `on_lost(key, lease, error)` is called: stop using the memory.

When the broker answers that the lease is gone (released, fenced, or its Redis lost its data)
while the holder's deadline has not passed, the lease is not live until it is settled: with
`reacquire` the same memory on the same GPUs is acquired again (a new lease, a new fencing
token; tried again, backing off, until the old lease's deadline, so a broker that is still
registering its node again has time to) and `on_replaced(key, old, new)` is called; if that
fails, `on_lost` is.

Callbacks run on the keeper's thread: a holder with an event loop hands them over with
`loop.call_soon_threadsafe`. Nothing the keeper does waits for the holder.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from loadmaster.client.lease_client import Lease, LeaseClient, LeaseLostError
from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.config import LeaseTiming
from loadmaster.common.errors import LoadmasterError
from loadmaster.common.retry import Backoff

__all__ = ["Held", "LeaseKeeper"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_START_TIMEOUT_S = 10.0


@dataclass(slots=True)
class Held:
    """One kept lease and its clock, on the holder's monotonic time. Pure bookkeeping."""

    lease: Lease
    timing: LeaseTiming
    deadline: float = -math.inf  # live while now < deadline
    next_renew: float = math.inf
    in_flight: bool = False
    settling: bool = False  # the broker said it is gone: re-acquiring

    @classmethod
    def granted(cls, lease: Lease, timing: LeaseTiming) -> Held:
        held = cls(lease, timing)
        held.renewed(lease)
        return held

    def renewed(self, lease: Lease) -> None:
        """A granted Acquire/Renew sent at `lease.sent_monotonic`: usable until then + deadline."""
        self.lease = lease
        self.deadline = max(self.deadline, lease.sent_monotonic + self.timing.holder_deadline_s)
        self.next_renew = lease.sent_monotonic + self.timing.renew_every_s

    def retry_later(self) -> None:
        """A renewal that failed without an answer (unreachable, too slow): next period."""
        self.next_renew += self.timing.renew_every_s

    def due(self, now: float, *, early: bool = False) -> bool:
        """Whether to send a renewal now; with `early`, up to half a period before its time
        (when another lease's renewal leaves anyway, so they travel together)."""
        ahead = self.timing.renew_every_s / 2 if early else 0.0
        return not (self.in_flight or self.settling) and now >= self.next_renew - ahead

    def lapsed(self, now: float) -> bool:
        return not self.settling and now >= self.deadline

    def live(self, now: float) -> bool:
        return not self.settling and now < self.deadline


class LeaseKeeper:
    def __init__(
        self,
        client: Callable[[], LeaseClient],
        *,
        on_lost: Callable[[str, Lease, LoadmasterError], None],
        on_replaced: Callable[[str, Lease, Lease], None] | None = None,
        reacquire: bool = True,
        owns_client: bool = True,
        clock: Clock | None = None,
        timing: Callable[[float], LeaseTiming] = LeaseTiming.for_ttl,
        name: str = "lease-keeper",
    ) -> None:
        self._make_client = client  # called on the keeper's thread: the client binds to its loop
        self._on_lost = on_lost
        self._on_replaced = on_replaced
        self._reacquire = reacquire
        self._owns_client = owns_client  # closed with the keeper (False: shared, the caller's)
        self._clock = clock or SystemClock()
        self._timing = timing
        self._name = name
        self._held: dict[str, Held] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: LeaseClient | None = None
        self._wake: asyncio.Event | None = None
        self._stopped: asyncio.Event | None = None
        self._ready = threading.Event()
        self._tasks: set[asyncio.Task[Any]] = set()

    # ---- the holder's side (any thread) ------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT_S):
            raise RuntimeError("the lease keeper's thread did not start")

    def keep(self, key: str, lease: Lease, *, ttl_s: float) -> None:
        """Renew `lease` under `key` from now on (replacing an earlier one of that key)."""
        with self._lock:
            self._held[key] = Held.granted(lease, self._timing(ttl_s))
        self._poke()

    def forget(self, key: str) -> Lease | None:
        """Stop renewing; returns the lease with its latest token (for release). A renewal of
        it in flight is ignored when it comes back."""
        with self._lock:
            held = self._held.pop(key, None)
        return held.lease if held is not None else None

    def lease(self, key: str) -> Lease | None:
        held = self._held.get(key)
        return held.lease if held is not None else None

    def live(self, key: str) -> bool:
        """Whether the lease under `key` is certainly ours now (cheap: any thread, any time)."""
        held = self._held.get(key)
        return held is not None and held.live(self._clock.monotonic())

    def deadline(self, key: str) -> float | None:
        held = self._held.get(key)
        return held.deadline if held is not None else None

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._held)

    def run(self, work: Callable[[LeaseClient], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
        """Run `work(client)` on the keeper's loop (the SDK acquires and releases there)."""
        if self._loop is None or self._client is None:
            raise RuntimeError("the lease keeper is not started")
        return asyncio.run_coroutine_threadsafe(work(self._client), self._loop)

    def close(self, *, timeout_s: float = 5.0) -> None:
        """Stop renewing (leases are not released: that is the holder's call) and end the thread."""
        loop, stopped = self._loop, self._stopped
        if self._thread is None or loop is None or stopped is None:
            return
        try:
            loop.call_soon_threadsafe(stopped.set)
        except RuntimeError:
            pass  # the loop is already closed
        self._thread.join(timeout_s)
        self._thread = None

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:
                pass  # closed

    # ---- the keeper's thread -------------------------------------------------------

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._run(loop))
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._wake, self._stopped = asyncio.Event(), asyncio.Event()
        self._client = self._make_client()
        self._ready.set()
        stop = asyncio.create_task(self._stopped.wait())
        try:
            while not self._stopped.is_set():
                try:
                    wake_at = self._step()
                except Exception:  # the loop never dies
                    log.exception("lease keeper step failed")
                    wake_at = self._clock.monotonic() + 0.1
                self._wake.clear()
                delay = wake_at - self._clock.monotonic()
                if delay > 0:
                    waits = [stop, asyncio.create_task(self._wake.wait())]
                    if math.isfinite(delay):
                        waits.append(asyncio.create_task(self._clock.sleep(delay)))
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    for waiter in waits[1:]:
                        waiter.cancel()
                else:
                    await asyncio.sleep(0)
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._owns_client:
                await self._client.close()

    def _step(self) -> float:
        """Send the renewals that are due, drop the leases past their deadline; returns when
        to look again."""
        now = self._clock.monotonic()
        due: list[tuple[str, Held]] = []
        lapsed: list[tuple[str, Held]] = []
        wake_at = math.inf
        with self._lock:
            for key, held in list(self._held.items()):
                if held.lapsed(now):
                    del self._held[key]
                    lapsed.append((key, held))
            early = any(held.due(now) for held in self._held.values())
            for key, held in self._held.items():
                if held.due(now, early=early):
                    held.in_flight = True
                    due.append((key, held))
                if not held.settling:
                    wake_at = min(wake_at, held.deadline)
                    if not held.in_flight:
                        wake_at = min(wake_at, held.next_renew)
        for key, held in lapsed:
            self._lost(
                key,
                held.lease,
                LeaseLostError(
                    f"lease {held.lease.lease_id} of {key}: no renewal succeeded within "
                    f"{held.timing.holder_deadline_s:.1f}s; stopped using it before the broker may re-grant it"
                ),
            )
        if due:
            self._spawn(self._renew(due), "lease-renew")
        return wake_at

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _renew(self, due: list[tuple[str, Held]]) -> None:
        assert self._client is not None
        client = self._client
        outcomes = await asyncio.gather(
            *(
                asyncio.wait_for(
                    client.renew(held.lease, ttl_s=held.timing.ttl_s), held.timing.renew_timeout_s
                )
                for _, held in due
            ),
            return_exceptions=True,
        )
        for (key, held), outcome in zip(due, outcomes, strict=True):
            with self._lock:
                if self._held.get(key) is not held:
                    continue  # forgotten, replaced or lapsed while the renewal travelled
                held.in_flight = False
                if isinstance(outcome, Lease):
                    held.renewed(outcome)
                    continue
                if not isinstance(outcome, LeaseLostError):
                    held.retry_later()
                    log.warning(
                        "renewing the lease of %s failed, will retry: %s", key, outcome or type(outcome)
                    )
                    continue
                if self._reacquire:
                    held.settling = True  # not live until settled
                else:
                    del self._held[key]
            log.warning("lease of %s: %s", key, outcome.message)
            if self._reacquire:
                self._spawn(self._settle(key, held, outcome), f"lease-reacquire-{key}")
            else:
                self._lost(key, held.lease, outcome)
        if self._wake is not None:
            self._wake.set()

    async def _settle(self, key: str, held: Held, error: LeaseLostError) -> None:
        """The broker says the lease is gone (say its Redis lost its data): the same memory
        on the same GPUs again, under a new lease, or `on_lost`."""
        assert self._client is not None
        old = held.lease
        first_s = max(0.02, held.timing.renew_every_s / 4)
        backoff = Backoff(first_s=first_s, max_s=max(first_s, held.timing.renew_every_s))
        while True:
            try:
                new = await self._client.acquire(
                    mb=old.mb,
                    ttl_s=held.timing.ttl_s,
                    labels=old.labels,
                    gpus=old.gpus,
                    allow_split=len(old.gpus) > 1,
                    node=old.node or None,
                )
                break
            except Exception as failure:
                # Say the broker has not registered its node again yet: try until the old
                # lease's deadline, backing off.
                if self._held.get(key) is not held:
                    return  # forgotten meanwhile
                delay = backoff.next_s()
                if self._clock.monotonic() + delay < held.deadline:
                    log.info("acquiring the lease of %s again failed (%s); retrying", key, failure)
                    await self._clock.sleep(delay)
                    continue
                with self._lock:
                    if self._held.get(key) is held:
                        del self._held[key]
                self._lost(key, old, LeaseLostError(f"{error.message}; acquiring it again failed: {failure}"))
                return
        with self._lock:
            current = self._held.get(key) is held
            if current and dict(new.mb_per_gpu) == dict(old.mb_per_gpu):
                self._held[key] = Held.granted(new, held.timing)
        if not current or dict(new.mb_per_gpu) != dict(old.mb_per_gpu):
            try:
                await self._client.release(new)
            except Exception as failure:
                log.warning("releasing lease %s failed (it expires): %s", new.lease_id, failure)
            if current:
                with self._lock:
                    if self._held.get(key) is held:
                        del self._held[key]
                self._lost(key, old, LeaseLostError(f"{error.message}; the memory came back elsewhere"))
            return
        log.info(
            "lease of %s re-established: %s (token %d) replaces %s",
            key,
            new.lease_id,
            new.fencing_token,
            old.lease_id,
        )
        if self._on_replaced is not None:
            try:
                self._on_replaced(key, old, new)
            except Exception:
                log.exception("lease-replaced handler of %s failed", key)
        if self._wake is not None:
            self._wake.set()

    def _lost(self, key: str, lease: Lease, error: LoadmasterError) -> None:
        log.error("lease of %s lost: %s", key, error.message)
        try:
            self._on_lost(key, lease, error)
        except Exception:
            log.exception("lease-lost handler of %s failed", key)
