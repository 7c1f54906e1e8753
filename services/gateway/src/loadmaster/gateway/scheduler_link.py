"""The gateway's one long-lived `Session` stream to the scheduler.

`enqueue` / `complete` / `cancel` / `return_credit` calls only append to an outbox; a
writer task sends everything pending as one `SessionRequest`, so messages batch
by themselves under load. Grants, Rejects, Credits and credit revocations are
handed to callbacks.

Reports about requests run on dispatch credits (`report_run`, and `complete(...,
deferred=True)`) nothing waits on: the credit's slot stays lent either way. So
they wait up to `report_delay_s`, or until something that cannot wait goes out.
A run still running when its report leaves is enqueued with its credit id
(its RequestInfo is built only then); a run that ended before needs nothing more
from the scheduler and is only counted, in a `RunTally` per model and worker, unless
it failed retryably (then one `FinishedRun`: the scheduler queues it again). Under
load, with replies in well under `report_delay_s`, the stream then carries one
message per `report_delay_s` of a size that does not grow with the request rate
(on our 2-core VM an isolated stream message costs each side 0.2 to 0.3 ms of CPU,
a third of the gateway's work on a small request; building and parsing a report per
request cost both sides another ~40 us at 8 clients).

When the stream breaks,
`on_lost` is called at once (the dispatcher fails what was waiting for a grant)
and the link reconnects with backoff; while it is down, `connected` is False
and new requests are answered `unavailable` by the dispatcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import grpc

from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.grpc_client import FRESH_CONNECT_OPTIONS, aio_channel
from loadmaster.common.liveness import LIVENESS
from loadmaster.common.retry import Backoff
from loadmaster.v1 import scheduler_pb2, scheduler_pb2_grpc

__all__ = ["SchedulerLink"]

log = logging.getLogger(__name__)


class _Run(NamedTuple):
    """A credit run not reported yet: its RequestInfo is built only if it must be sent."""

    model_id: str
    info: Callable[[], scheduler_pb2.RequestInfo]


@dataclass(slots=True)
class _Tally:
    runs: int = 0
    failed: int = 0
    inference_ms: float = 0.0


@dataclass(slots=True)
class _Outbox:
    """What one session has yet to send.

    The scheduler applies a message's completes, then finished runs, returns, enqueues
    and cancels. A credit runs one request at a time, so by the time its next run is in
    `runs`, its earlier runs are in `finished` or their Completes in `completes`: runs go
    out only in a message that empties those two lists."""

    enqueues: list[scheduler_pb2.RequestInfo] = field(default_factory=list)
    # Credit runs not sent yet, by request id: a Complete for one of them makes it finished.
    runs: dict[str, _Run] = field(default_factory=dict)
    tallies: dict[tuple[str, str], _Tally] = field(default_factory=dict)  # (model, worker) -> ended runs
    completes: list[scheduler_pb2.Complete] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # request ids
    returns: list[str] = field(default_factory=list)  # credit ids
    finished: list[scheduler_pb2.FinishedRun] = field(default_factory=list)
    # model -> its local queue's new depth, and the demand since the last report (call-seconds)
    depths: dict[str, tuple[int, float]] = field(default_factory=dict)
    urgent: bool = False  # holds something that cannot wait (an enqueue, cancel, return, Complete)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    report_timer: asyncio.TimerHandle | None = None

    def __bool__(self) -> bool:
        return bool(
            self.enqueues
            or self.runs
            or self.completes
            or self.cancels
            or self.returns
            or self.finished
            or self.depths
            or self.tallies
        )

    def defer(self, delay_s: float) -> None:
        """Send within `delay_s` (sooner if something that cannot wait comes first)."""
        if self.report_timer is None and not self.wake.is_set():
            self.report_timer = asyncio.get_running_loop().call_later(delay_s, self.wake.set)

    def now(self) -> None:
        """Something that cannot wait was added: send at once."""
        self.urgent = True
        self.wake.set()

    def sent(self) -> None:
        if self.report_timer is not None:
            self.report_timer.cancel()
            self.report_timer = None


class SchedulerLink:
    def __init__(
        self,
        address: str,
        gateway_id: str,
        *,
        on_grant: Callable[[scheduler_pb2.Grant], None],
        on_reject: Callable[[scheduler_pb2.Reject], None],
        on_lost: Callable[[], None],
        on_credit: Callable[[scheduler_pb2.Credit], None] | None = None,
        on_revoke: Callable[[str], None] | None = None,
        on_placement: Callable[[scheduler_pb2.Placement], None] | None = None,
        max_batch: int = 256,
        connect_timeout_s: float = 1.0,
        report_delay_s: float = 0.02,
        clock: Clock | None = None,
    ) -> None:
        self._address = address
        self._clock: Clock = clock or SystemClock()
        self._gateway_id = gateway_id
        self._on_grant = on_grant
        self._on_reject = on_reject
        self._on_lost = on_lost
        self._on_credit = on_credit
        self._on_revoke = on_revoke
        self._on_placement = on_placement
        self._max_batch = max_batch
        self._connect_timeout_s = connect_timeout_s
        self._report_delay_s = report_delay_s
        self._outbox = _Outbox()
        self._connected = asyncio.Event()
        self._session = 0
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def session(self) -> int:
        """Which session is (or was last) open; each new session gets the next number. A
        request enqueued on an earlier session is unknown to the scheduler of a later one."""
        return self._session

    # -- outbox (called from the event loop thread) ---------------------------------

    def enqueue(self, request: scheduler_pb2.RequestInfo) -> None:
        """Queue a request for a grant."""
        self._outbox.enqueues.append(request)
        self._outbox.now()

    def report_run(
        self,
        request_id: str,
        model_id: str,
        info: Callable[[], scheduler_pb2.RequestInfo],
    ) -> None:
        """Report a request already sent on a credit; `info()` builds its RequestInfo (credit_id
        set) if it must be sent: if it ends before its report leaves, it is only counted."""
        self._outbox.runs[request_id] = _Run(model_id, info)
        self._outbox.defer(self._report_delay_s)

    def report_local_depth(self, model_id: str, waiting: int, outstanding_s: float = 0.0) -> None:
        """How many requests wait in the gateway's local queue for the model (sent later: the
        scheduler counts them in the model's queue depth), and the demand since the last report
        (`outstanding_s`, call-seconds: summed until sent)."""
        if self.connected:
            depth = self._outbox.depths.get(model_id)
            self._outbox.depths[model_id] = (waiting, outstanding_s + (depth[1] if depth else 0.0))
            self._outbox.defer(self._report_delay_s)

    def complete(
        self,
        request_id: str,
        *,
        error_code: int = 0,
        retryable: bool = False,
        worker_id: str = "",
        inference_ms: float = 0.0,
        deferred: bool = False,
    ) -> None:
        """Report a request's end; `deferred` for the end of a credit run whose credit stays
        usable (nothing waits on it, so it may wait for the next message)."""
        if not self.connected:
            return  # the scheduler forgot this session's requests when the stream broke
        outbox = self._outbox
        run = outbox.runs.pop(request_id, None)
        if run is not None and not (error_code and retryable):  # ended before its report
            tally = outbox.tallies.get((run.model_id, worker_id))
            if tally is None:
                tally = outbox.tallies[(run.model_id, worker_id)] = _Tally()
            tally.runs += 1
            tally.failed += error_code != 0
            tally.inference_ms += inference_ms
            if deferred:
                outbox.defer(self._report_delay_s)
            else:
                outbox.now()
            return
        message = scheduler_pb2.Complete(
            request_id=request_id,
            error_code=error_code,  # type: ignore[arg-type]
            retryable=retryable,
            worker_id=worker_id,
            inference_ms=inference_ms,
        )
        if run is None:
            outbox.completes.append(message)
        else:
            outbox.finished.append(scheduler_pb2.FinishedRun(request=run.info(), complete=message))
        if deferred:
            outbox.defer(self._report_delay_s)
        else:
            outbox.now()

    def cancel(self, request_id: str) -> None:
        if self.connected:
            self._outbox.cancels.append(request_id)
            self._outbox.now()

    def return_credit(self, credit_id: str) -> None:
        if self.connected:
            self._outbox.returns.append(credit_id)
            self._outbox.now()

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="scheduler-link")

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _outgoing(self, outbox: _Outbox) -> AsyncIterator[scheduler_pb2.SessionRequest]:
        """The messages of one session; a broken session's generator never sees later messages."""
        hello = scheduler_pb2.SessionHello(
            gateway_id=self._gateway_id, accepts_credits=self._on_credit is not None
        )
        yield scheduler_pb2.SessionRequest(hello=hello)
        batch = self._max_batch
        while True:
            await outbox.wake.wait()
            outbox.wake.clear()
            outbox.sent()
            while outbox:
                outbox.urgent = False
                message = scheduler_pb2.SessionRequest()
                message.complete.extend(outbox.completes[:batch])
                del outbox.completes[:batch]
                message.finished_run.extend(outbox.finished[:batch])
                del outbox.finished[:batch]
                message.return_credit.extend(outbox.returns[:batch])
                del outbox.returns[:batch]
                message.cancel.extend(outbox.cancels[:batch])
                del outbox.cancels[:batch]
                if outbox.tallies:
                    for (model_id, worker_id), tally in outbox.tallies.items():
                        message.run_tally.add(
                            model_id=model_id,
                            worker_id=worker_id,
                            runs=tally.runs,
                            failed=tally.failed,
                            inference_ms=tally.inference_ms,
                        )
                    outbox.tallies.clear()
                if outbox.depths:
                    for model_id, (waiting, outstanding_s) in outbox.depths.items():
                        message.local_queue_depth.add(
                            model_id=model_id, waiting=waiting, outstanding_s=outstanding_s
                        )
                    outbox.depths.clear()
                if not (outbox.completes or outbox.finished):  # see _Outbox
                    for request_id in list(itertools.islice(outbox.runs, batch)):
                        message.enqueue.append(outbox.runs.pop(request_id).info())
                    message.enqueue.extend(outbox.enqueues[:batch])
                    del outbox.enqueues[:batch]
                yield message
                if outbox and not outbox.urgent:
                    # Only reports arrived while that message was written: they wait for the
                    # next one like any report (else, under load, every write completion
                    # would send a message of a few reports: one per request, not per 20 ms).
                    outbox.defer(self._report_delay_s)
                    break

    async def _run(self) -> None:
        backoff = Backoff(first_s=0.05, max_s=1.0)
        while not self._closing:
            try:
                options = [*FRESH_CONNECT_OPTIONS, *LIVENESS.grpc_options()]  # a silent scheduler: 1.8 s
                async with aio_channel(self._address, options=options) as channel:
                    await asyncio.wait_for(channel.channel_ready(), self._connect_timeout_s)
                    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
                    self._outbox = _Outbox()
                    call = stub.Session(self._outgoing(self._outbox))
                    self._session += 1
                    self._connected.set()
                    log.info("session to scheduler %s open", self._address)
                    backoff.reset()
                    async for response in call:
                        for grant in response.grants:
                            self._on_grant(grant)
                        # Credits before rejects: a request handed back to this gateway's local
                        # queue (`use_share`) comes with the credit it is to run on.
                        if self._on_credit is not None:
                            for credit in response.credits:
                                self._on_credit(credit)
                        for reject in response.rejects:
                            self._on_reject(reject)
                        if self._on_revoke is not None:
                            for credit_id in response.revokes:
                                self._on_revoke(credit_id)
                        if self._on_placement is not None:
                            for placement in response.placements:
                                self._on_placement(placement)
                    log.warning("scheduler %s ended the session", self._address)
            except asyncio.CancelledError:
                self._mark_lost()
                raise
            except (TimeoutError, grpc.aio.AioRpcError, OSError) as error:
                if self.connected:
                    detail = error.code().name if isinstance(error, grpc.aio.AioRpcError) else repr(error)
                    log.warning("session to scheduler %s lost: %s", self._address, detail)
            except Exception:
                log.exception("session to scheduler %s failed", self._address)
            self._mark_lost()
            if self._closing:
                return
            await self._clock.sleep(backoff.next_s())

    def _mark_lost(self) -> None:
        was_connected = self.connected
        self._connected.clear()
        self._outbox.sent()
        self._outbox = _Outbox()  # what the broken session had not sent is answered via on_lost
        if was_connected:
            self._on_lost()
