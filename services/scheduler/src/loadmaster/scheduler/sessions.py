"""The live side of the scheduler: open streams, their outboxes, and the expiry timer.

`SchedulerHub` owns the `SchedulerCore`, routes its answers into per-stream
outboxes and keeps one timer armed at the earliest queued deadline (no polling:
an idle scheduler sleeps). `pump` runs a bidi stream: a reader task feeds inbound
messages to a handler while the caller drains the outbox, everything pending at
once, so answers are batched naturally under load.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from opentelemetry import trace

from loadmaster.common import ordering as strategies
from loadmaster.common import tracing
from loadmaster.common.clock import Clock
from loadmaster.common.errors import edge_code_name
from loadmaster.common.ordering import Ordering
from loadmaster.scheduler.config import StrategyFactory
from loadmaster.scheduler.core import CoreConfig, SchedulerCore
from loadmaster.scheduler.domain import (
    Credit,
    CreditRevoke,
    Grant,
    Outcome,
    PlacedWorker,
    Placement,
    Reject,
    RemoteService,
    SlotStatus,
    Submission,
    WorkerCommand,
    WorkerHello,
)
from loadmaster.scheduler.outbound import Telemetry
from loadmaster.scheduler.placement import generative_placements
from loadmaster.scheduler.tenant_service import TenantServiceExchange

__all__ = ["DeadlineTimer", "GatewayLink", "Outbox", "SchedulerHub", "WorkerLink", "pump"]

log = logging.getLogger(__name__)

T = TypeVar("T")
In = TypeVar("In")

_SLOW_STEP_S = 0.05


class Outbox(Generic[T]):
    """An unbounded mailbox whose reader takes everything pending at once."""

    __slots__ = ("_closed", "_items", "_ready")

    def __init__(self) -> None:
        self._items: collections.deque[T] = collections.deque()
        self._ready = asyncio.Event()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T) -> None:
        if self._closed:
            return
        self._items.append(item)
        self._ready.set()

    def close(self) -> None:
        """No more items; `take_all` returns what is left, then []."""
        self._closed = True
        self._ready.set()

    async def take_all(self) -> list[T]:
        """Everything pending (waiting for at least one item); [] once closed and empty."""
        while not self._items:
            if self._closed:
                return []
            self._ready.clear()
            await self._ready.wait()
        items = list(self._items)
        self._items.clear()
        return items


async def pump(
    inbound: AsyncIterable[In], handle: Callable[[In], None], outbox: Outbox[T]
) -> AsyncIterator[list[T]]:
    """Feed `inbound` to `handle` in a reader task; yield batches from `outbox`.

    Ends when the inbound stream ends (after flushing the outbox) or when the outbox
    is closed from elsewhere; an exception from the reader is raised here.
    """

    async def read() -> None:
        try:
            async for message in inbound:
                handle(message)
        finally:
            outbox.close()

    reader = asyncio.create_task(read(), name="scheduler-stream-reader")
    try:
        while items := await outbox.take_all():
            yield items
        if reader.done() and not reader.cancelled() and (error := reader.exception()) is not None:
            raise error
    finally:
        if not reader.done():
            reader.cancel()


@dataclass(eq=False, slots=True)
class GatewayLink:
    session_id: int
    gateway_id: str
    outbox: Outbox[Outcome | Credit | CreditRevoke | Placement] = field(default_factory=Outbox)


@dataclass(eq=False, slots=True)
class WorkerLink:
    worker_id: str
    outbox: Outbox[WorkerCommand] = field(default_factory=Outbox)


class DeadlineTimer:
    """One `call_later` handle, kept armed at a deadline on the clock's monotonic scale."""

    def __init__(self, clock: Clock, callback: Callable[[], None]) -> None:
        self._clock = clock
        self._callback = callback
        self._handle: asyncio.TimerHandle | None = None
        self._deadline: float | None = None

    @property
    def deadline(self) -> float | None:
        return self._deadline

    def arm(self, deadline: float | None) -> None:
        """Fire at `deadline` (None: never). A timer already armed earlier is kept: it
        fires, finds nothing due and is re-armed, which costs less than re-arming on
        every grant."""
        if deadline is None:
            self.cancel()
            return
        if self._deadline is not None and self._deadline <= deadline:
            return
        self.cancel()
        delay = max(0.0, deadline - self._clock.monotonic())
        self._handle = asyncio.get_running_loop().call_later(delay, self._fire)
        self._deadline = deadline

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = None
        self._deadline = None

    def _fire(self) -> None:
        self._handle = None
        self._deadline = None
        self._callback()


class SchedulerHub:
    """Routes the core's answers to streams and keeps the expiry timer armed.

    Every entry point runs one core call, then re-arms the timer; all of it on the
    event loop thread, so the core needs no locks.
    """

    def __init__(
        self,
        config: CoreConfig,
        *,
        clock: Clock,
        ordering: Ordering | None = None,
        telemetry: Telemetry | None = None,
        make_ordering: StrategyFactory | None = None,
    ) -> None:
        self._clock = clock
        self._make_ordering: StrategyFactory = make_ordering or (
            lambda name, policy: strategies.make_ordering(name, policy=policy)
        )
        self.core = SchedulerCore(config, clock=clock, outbound=self, ordering=ordering, telemetry=telemetry)
        self._sessions: dict[int, GatewayLink] = {}
        self._workers: dict[str, WorkerLink] = {}
        self._tenant_service = TenantServiceExchange()
        self._placements: dict[str, tuple[PlacedWorker, ...]] = {}  # as last told to gateways
        self._session_ids = itertools.count(1)
        self._timer = DeadlineTimer(clock, self._on_timer)
        self._stopped = False
        # Queue spans of traced requests only (empty while tracing is off).
        self._spans: dict[tuple[int, str], trace.Span] = {}

    # ---- gateway sessions --------------------------------------------------------

    def open_session(self, gateway_id: str, *, accepts_credits: bool = False) -> GatewayLink:
        link = GatewayLink(next(self._session_ids), gateway_id)
        if self._stopped:
            link.outbox.close()  # shutting down: the stream ends at once
            return link
        self._sessions[link.session_id] = link
        for model_id, workers in sorted(self._placements.items()):  # where generations go, so far
            link.outbox.put(Placement(model_id, workers))
        if accepts_credits:
            self.core.accept_credits(link.session_id)
        log.info("gateway %s connected (session %d)", gateway_id, link.session_id)
        return link

    def submit(self, link: GatewayLink, batch: Submission) -> None:
        if self._sessions.get(link.session_id) is not link:
            return
        # Credit runs never waited: their queue span is an instant.
        for run in itertools.chain(batch.runs, (done.run for done in batch.finished)):
            if run.info.trace_context:
                span = tracing.start_request_span(
                    "scheduler.queue",
                    request_id=run.info.request_id,
                    model_id=run.info.model_id,
                    carrier=run.info.trace_context,
                )
                span.set_attribute("loadmaster.credit_id", run.credit_id)
                tracing.end_span(span, error_code="")
        for info in batch.enqueues:
            if info.trace_context:
                self._spans[(link.session_id, info.request_id)] = tracing.start_request_span(
                    "scheduler.queue",
                    request_id=info.request_id,
                    model_id=info.model_id,
                    carrier=info.trace_context,
                )
        for request_id in batch.cancels:
            self._end_span(link.session_id, request_id, "cancelled")
        self.core.submit(link.session_id, batch)
        self._rearm()

    def close_session(self, link: GatewayLink) -> None:
        if self._sessions.pop(link.session_id, None) is None:
            return
        link.outbox.close()
        self.core.close_session(link.session_id)
        for key in [key for key in self._spans if key[0] == link.session_id]:
            self._end_span(*key, "cancelled")
        self._rearm()
        log.info("gateway %s disconnected (session %d)", link.gateway_id, link.session_id)

    # ---- worker sessions ---------------------------------------------------------

    def connect_worker(self, hello: WorkerHello) -> WorkerLink:
        link = WorkerLink(hello.worker_id)
        if self._stopped:
            link.outbox.close()
            return link
        old = self._workers.get(hello.worker_id)
        if old is not None:
            log.warning("worker %s reconnected; closing its previous session", hello.worker_id)
            old.outbox.close()
        self._workers[hello.worker_id] = link
        self.core.add_worker(hello)  # replaces a previous registration under this id
        self._rearm()
        self._publish_placements()
        log.info("worker %s connected (repository: %s)", hello.worker_id, ", ".join(hello.repository))
        return link

    def report(self, link: WorkerLink, slots: Sequence[SlotStatus], *, free_mb: int = 0) -> None:
        if self._workers.get(link.worker_id) is not link:
            return  # a replaced session still talking
        self.core.update_worker(link.worker_id, slots, free_mb=free_mb)
        self._rearm()
        self._publish_placements()

    def _publish_placements(self) -> None:
        """Tell every gateway where each generative model is served now, when that changed."""
        placements = generative_placements(self.core.workers())
        changed = [
            Placement(model_id, placements.get(model_id, ()))
            for model_id in sorted(set(placements) | set(self._placements))
            if placements.get(model_id, ()) != self._placements.get(model_id, ())
        ]
        if not changed:
            return
        self._placements = {model_id: workers for model_id, workers in placements.items() if workers}
        for session in self._sessions.values():
            for placement in changed:
                session.outbox.put(placement)

    def tenant_service(self, link: WorkerLink, service: dict[str, dict[str, float]]) -> None:
        """A worker's service per tenant: tell the others that serve those models."""
        if self._workers.get(link.worker_id) is not link:
            return
        self._send_remote(self._tenant_service.report(link.worker_id, service))

    def _send_remote(self, updates: dict[str, dict[str, dict[str, float]]]) -> None:
        for worker_id, models in updates.items():
            other = self._workers.get(worker_id)
            if other is not None:
                other.outbox.put(RemoteService(models))

    # ---- admin -------------------------------------------------------------------

    def set_strategy(self, name: str, policy: str | None = None) -> tuple[str, int]:
        """Switch the ordering (ValueError for an unknown name/policy); (previous, moved)."""
        ordering = self._make_ordering(name, policy or None)
        previous = self.core.strategy
        moved = self.core.set_ordering(ordering)
        self._rearm()
        return previous, moved

    def disconnect_worker(self, link: WorkerLink) -> None:
        link.outbox.close()
        if self._workers.get(link.worker_id) is not link:
            return
        del self._workers[link.worker_id]
        self.core.remove_worker(link.worker_id)
        self._publish_placements()
        self._send_remote(self._tenant_service.forget(link.worker_id))
        self._rearm()
        log.info("worker %s disconnected", link.worker_id)

    # ---- lifecycle ---------------------------------------------------------------

    async def stop(self) -> None:
        """End every stream (their handlers return) and disarm the timer."""
        self._stopped = True
        self._timer.cancel()
        for session in list(self._sessions.values()):
            session.outbox.close()
        for worker in list(self._workers.values()):
            worker.outbox.close()

    # ---- Outbound (called by the core) -----------------------------------------------

    def grant(self, session_id: int, grant: Grant) -> None:
        if self._spans:
            self._end_span(session_id, grant.request_id, "")
        link = self._sessions.get(session_id)
        if link is not None:
            link.outbox.put(grant)

    def reject(self, session_id: int, reject: Reject) -> None:
        if self._spans:
            self._end_span(session_id, reject.request_id, edge_code_name(reject.error_code))
        link = self._sessions.get(session_id)
        if link is not None:
            link.outbox.put(reject)

    def lend_credit(self, session_id: int, credit: Credit) -> None:
        link = self._sessions.get(session_id)
        if link is not None:
            link.outbox.put(credit)

    def revoke_credit(self, session_id: int, credit_id: str) -> None:
        link = self._sessions.get(session_id)
        if link is not None:
            link.outbox.put(CreditRevoke(credit_id))

    def command(self, worker_id: str, command: WorkerCommand) -> None:
        link = self._workers.get(worker_id)
        if link is not None:
            link.outbox.put(command)

    def _end_span(self, session_id: int, request_id: str, error_code: str) -> None:
        span = self._spans.pop((session_id, request_id), None)
        if span is not None:
            tracing.end_span(span, error_code=error_code)

    # ---- timer -------------------------------------------------------------------

    def _rearm(self) -> None:
        if not self._stopped:
            self._timer.arm(self.core.next_deadline())

    def _on_timer(self) -> None:
        started = self._clock.monotonic()
        try:
            self.core.expire_due()
        except Exception:
            log.exception("expiring due requests failed")
        took = self._clock.monotonic() - started
        if took > _SLOW_STEP_S:
            log.warning("expiry step took %.1f ms", took * 1000.0)
        try:
            self._rearm()
        except Exception:
            log.exception("re-arming the expiry timer failed")
