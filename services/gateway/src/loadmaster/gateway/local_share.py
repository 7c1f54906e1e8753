"""The dispatcher's side of a whole share: calls waiting in the gateway for a model whose every
slot it holds (docs/data-path.md), wired to the credits and the scheduler session.

`LocalQueues` ranks and holds the calls; this module decides when they enter (the credits
carried a local queue and one of them is still usable), when they leave (a credit frees, their
deadline passes, the share goes: then to the scheduler, in order), and tells the scheduler the
depth, which it counts in the model's queue depth, and the demand: the integral over time of
the model's calls waiting here or running on a credit, by which the scheduler splits a model
between the gateways that use it.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from loadmaster.common.clock import Clock
from loadmaster.common.errors import ExpiredError, LoadmasterError, OverflowError_
from loadmaster.common.ordering import SortKey
from loadmaster.gateway.calls import InferenceCall
from loadmaster.gateway.held_credits import HeldCredit, HeldCredits
from loadmaster.gateway.local_queue import LocalQueues
from loadmaster.gateway.ports import SchedulerPort
from loadmaster.v1 import scheduler_pb2

__all__ = ["MAX_FRONTS", "LocalShare"]

# A model's calls are staged only while its inference time is steady: the deviation of its
# samples from their mean (EWMAs, as TCP's RTTVAR) within this share of the mean, or this
# little. Behind a call that may take 1 ms or 1.5 s, a staged call could wait 1.5 s while
# another slot frees.
_ALPHA, _BETA = 0.2, 0.25  # weights of the newest sample in the mean and in the deviation
_STEADY, _STEADY_FLOOR_MS = 0.25, 0.5
_MIN_GAPS = 3  # gaps seen before a client's cadence is trusted (holds)
_HOLD_GRACE_S = 0.001  # a hold lasts this long past the predicted arrival, at least
_HOLD_MARGIN_S = 0.0005  # an answer this close to its client's budget counts as late
_SILENT_S = 10.0  # a client silent this long is forgotten (its cadence starts afresh)

# Calls of one model sent ahead of staged ones and not yet answered, at most. Measured on the
# overload bench (docs/data-path.md, "Staged calls"): one at a time left two priority-0 clients
# a service time apart waiting behind each other's staged calls (50-56 % on time).
MAX_FRONTS = 2


class _HasCall(Protocol):
    @property
    def call(self) -> InferenceCall: ...


P = TypeVar("P", bound=_HasCall)


@dataclass(slots=True)
class _Ewma:
    """EWMAs of a quantity's samples and of their distance from it (as TCP's SRTT and RTTVAR)."""

    mean: float
    deviation: float

    def add(self, sample: float) -> None:
        self.deviation += _BETA * (abs(sample - self.mean) - self.deviation)
        self.mean += _ALPHA * (sample - self.mean)

    def steady(self, floor: float = 0.0) -> bool:
        return self.deviation <= max(_STEADY * self.mean, floor)


@dataclass(slots=True)
class _ServiceTime(_Ewma):
    """A model's inference time (ms) as its replies report it."""

    path_ms: float = 0.0  # EWMA of a call's time to its worker and back, besides its runs

    def learn(self, sample_ms: float, path_ms: float) -> None:
        self.add(sample_ms)
        self.path_ms += _ALPHA * (max(0.0, path_ms) - self.path_ms)


@dataclass(slots=True)
class _Arrivals:
    """One client's calls for one model at this gateway: when the last came, its gaps (s) and how
    many, and what the client asks (priority, budget)."""

    last: float
    priority: int
    budget_s: float
    gap: _Ewma | None = None
    gaps: int = 0

    def arrived(self, now: float, priority: int, budget_s: float) -> None:
        gap = max(0.0, now - self.last)
        if self.gap is None:
            self.gap = _Ewma(gap, gap / 2)
        else:
            self.gap.add(gap)
        self.gaps += 1
        self.last, self.priority, self.budget_s = now, priority, budget_s

    def next_arrival(self) -> float | None:
        """When its next call is due, for a client with a steady cadence (None: not one)."""
        if self.gap is None or self.gaps < _MIN_GAPS or not self.gap.steady():
            return None
        return self.last + self.gap.mean

    def lateness_s(self) -> float:
        """How late its next call may come and still be waited for."""
        return 2 * self.gap.deviation if self.gap is not None else 0.0


class _Cadences:
    """One model's edge clients, and a heap of when those with a steady cadence are next due:
    a hold looks only at the clients due soon (about as many as the model serves in that
    time), not at every client. A client has one live entry; the entries an arrival or a
    forgotten client left behind are dropped as they come to the top."""

    def __init__(self) -> None:
        self.clients: dict[str, _Arrivals] = {}
        self._heap: list[tuple[float, str]] = []  # (next arrival, client)

    def __len__(self) -> int:
        """Entries in the heap: the live ones, and superseded ones not dropped yet."""
        return len(self._heap)

    def arrived(self, client_id: str, now: float, priority: int, budget_s: float) -> None:
        arrivals = self.clients.get(client_id)
        if arrivals is None:
            self.clients[client_id] = _Arrivals(now, priority, budget_s)
            return
        arrivals.arrived(now, priority, budget_s)
        heap = self._heap
        if (at := arrivals.next_arrival()) is not None:
            heapq.heappush(heap, (at, client_id))
        while heap and not self._live(*heap[0], missed_before=now):
            heapq.heappop(heap)

    def due(
        self, now: float, before: float, slack: Callable[[_Arrivals], float]
    ) -> list[tuple[float, str, _Arrivals, float]]:
        """(next arrival, client, its cadence, until when it is waited for) of the clients due
        before `before` and not later than `slack` past it."""
        heap = self._heap
        due: list[tuple[float, str, _Arrivals, float]] = []
        kept: list[tuple[float, str]] = []
        while heap and heap[0][0] < before:
            at, client_id = entry = heapq.heappop(heap)
            if not self._live(at, client_id):
                continue
            kept.append(entry)
            if now < (until := at + slack(arrivals := self.clients[client_id])):
                due.append((at, client_id, arrivals, until))
        for entry in kept:
            heapq.heappush(heap, entry)
        return due

    def _live(self, at: float, client_id: str, missed_before: float = -math.inf) -> bool:
        """The client's entry is its current one, and not missed by a whole gap (`missed_before`:
        now; a client that late is not waited for, whatever its slack)."""
        arrivals = self.clients.get(client_id)
        return (
            arrivals is not None
            and arrivals.gap is not None
            and arrivals.next_arrival() == at
            and at + arrivals.gap.mean >= missed_before
        )

    def forget(self, horizon: float) -> None:
        """Forget the clients silent since before `horizon`."""
        for client_id in [c for c, a in self.clients.items() if a.last < horizon]:
            del self.clients[client_id]  # (client ids come and go: this table must not grow)


class LocalShare(Generic[P]):
    """`take(model)` gives an idle usable credit; `start(p, credit, key, front)` sends a call on
    it (False: its worker was unreachable and the credit went back); `to_scheduler(p)` queues a call with
    the scheduler; `fail(p, error)` answers it."""

    def __init__(
        self,
        *,
        clock: Clock,
        scheduler: SchedulerPort,
        credits: HeldCredits,
        take: Callable[[str], HeldCredit | None],
        start: Callable[[P, HeldCredit, SortKey | None, bool], bool],
        to_scheduler: Callable[[P], None],
        fail: Callable[[P, LoadmasterError], None],
    ) -> None:
        self._clock = clock
        self._scheduler = scheduler
        self._credits = credits
        self._take = take
        self._start = start
        self._to_scheduler = to_scheduler
        self._fail = fail
        self._queues: LocalQueues[P] = LocalQueues(clock)
        self._ttl_ms: dict[str, float] = {}  # model -> its TTL, as its credits carry it
        self._timer: asyncio.TimerHandle | None = None  # the expiry of the earliest deadline
        self._timer_at = math.inf
        # model -> [its calls waiting here or running on a credit, since when (monotonic),
        # call-seconds since the last report]
        self._demand: dict[str, list[float]] = {}
        self._waiting: dict[str, int] = {}  # model -> its waiting calls as last counted
        self._service: dict[str, _ServiceTime] = {}  # model -> its inference time (staging)
        self._cadences: dict[str, _Cadences] = {}  # model -> its edge clients' cadences
        self._holds: dict[str, asyncio.TimerHandle] = {}  # model -> the end of its slot's hold

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._queues

    def waiting(self, model_id: str) -> int:
        return self._queues.waiting(model_id)

    def accepts(self, model_id: str) -> bool:
        return self._queues.accepts(model_id)

    def configure(self, model_id: str, spec: scheduler_pb2.LocalQueue, ttl_ms: float) -> None:
        """A credit for the model arrived: queue by its spec from now on."""
        self._ttl_ms[model_id] = ttl_ms
        self._queues.configure(model_id, spec)

    def may_queue(self, model_id: str) -> bool:
        """The model's calls may wait here: its credits carried a local queue and one is still
        usable (the last may have gone unannounced: an earlier session's, dropped once a new
        session's scheduler serves; then the waiting calls go to it)."""
        if not self._queues.accepts(model_id):
            return False
        self.hand_over(model_id)  # (a no-op while a usable credit is held)
        return self._queues.accepts(model_id)

    def queue(self, pending: P) -> None:
        call = pending.call
        overflow = self._queues.push(pending, call, self._ttl(call))
        if overflow is not None:
            if overflow.refused:
                self._fail(pending, OverflowError_(overflow.message))
                return
            if overflow.dropped is not None:
                self._fail(overflow.dropped, OverflowError_(overflow.message))
        self._arrived(call)
        self._changed(call.model_id)
        self._arm()
        self.serve(call.model_id)

    def started(self, call: InferenceCall) -> None:
        """`call` runs at once on an idle credit: the local order counts it as served on arrival."""
        self._arrived(call)
        self._queues.started(call, self._ttl(call))

    def ended(self, call: InferenceCall) -> None:
        """A call that ran on a credit has its answer."""
        self._queues.ended(call)

    def served(self, model_id: str, inference_ms: float, path_ms: float) -> None:
        """A call of the model ran in `inference_ms` (its worker's reply says), and spent
        `path_ms` more on the way there and back."""
        service = self._service.get(model_id)
        if service is None:
            self._service[model_id] = _ServiceTime(inference_ms, inference_ms / 2, max(0.0, path_ms))
        else:
            service.learn(inference_ms, path_ms)

    def _arrived(self, call: InferenceCall) -> None:
        """Learn the cadence of an edge client (one that sends on its own schedule)."""
        if not call.client_id or call.connection_bound:
            return
        now = self._clock.monotonic()
        budget_s = self._queues.budget_ms(call.model_id, call.client_id) / 1000.0
        cadences = self._cadences.get(call.model_id)
        if cadences is None:
            cadences = self._cadences[call.model_id] = _Cadences()
        cadences.arrived(call.client_id, now, call.priority, budget_s)

    def holds(self, call: InferenceCall, start_s: float | None = None) -> bool:
        """Starting `call` at `start_s` (monotonic; default now) would make a more urgent
        client's next call late that would be on time without it (reservations: the blind spot
        of non-preemptive scheduling, two urgent clients that send together). Then the slot
        stays free for it until it is due, and `serve` looks again (a timer, or its arrival).
        A client a little late (by up to twice its gaps' deviation, or a path) is still waited for."""
        model_id = call.model_id
        service = self._service.get(model_id)
        cadences = self._cadences.get(model_id)
        if (
            service is None
            or not service.steady(_STEADY_FLOOR_MS)
            or cadences is None
            or not self._queues.ranks_by_priority(model_id)
        ):
            return False
        now = self._clock.monotonic()
        start = now if start_s is None else max(now, start_s)
        run_s, path_s = service.mean / 1000.0, service.path_ms / 1000.0
        # The client's own legs are not seen here: they count as a gateway <-> worker path more.
        margin_s = _HOLD_MARGIN_S + service.deviation / 1000.0 + path_s
        due = sorted(  # (when it reaches the gateway, its budget, until when it is waited for)
            (max(at, now), a.budget_s, until)
            for at, client_id, a, until in cadences.due(
                now, start + run_s, lambda a: max(_HOLD_GRACE_S, path_s, a.lateness_s())
            )
            if a.priority < call.priority and not self._queues.outstanding(client_id, model_id)
        )
        if (
            not due
            or not _late(due, start + run_s, run_s, path_s, margin_s)
            or _late(due, start, run_s, path_s, margin_s)
        ):
            return False
        self._hold(model_id, min(until for _, _, until in due))
        return True

    def _hold(self, model_id: str, until: float) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # (a unit test without a loop serves itself)
            return
        if (timer := self._holds.pop(model_id, None)) is not None:
            timer.cancel()
        delay = max(0.0, until - self._clock.monotonic())
        self._holds[model_id] = loop.call_later(delay, self._lapsed, model_id)

    def _lapsed(self, model_id: str) -> None:
        self._holds.pop(model_id, None)
        self.serve(model_id)

    def _ttl(self, call: InferenceCall) -> float:
        ttl_ms = self._ttl_ms.get(call.model_id, 0.0)
        if call.timeout_ms > 0:
            ttl_ms = min(ttl_ms, call.timeout_ms) if ttl_ms else call.timeout_ms
        return ttl_ms

    def serve(self, model_id: str) -> None:
        """Send waiting calls, in order, while the model's credits have room: an idle credit
        runs the head at once; a busy one takes up to the spec's `stage` calls behind the one it
        runs, so its worker never waits for the next call's trip (while the model's inference
        time is steady); and a head more urgent than a
        call staged that way goes to the front of that call's worker queue (at most
        `MAX_FRONTS` at a time), so staging never makes it wait a service time longer."""
        started = False
        while (head := self._queues.peek(model_id)) is not None:
            key, waiting = head
            credit, front = self._room(model_id, key)
            if credit is None:
                break
            if self.holds(waiting.call, credit.started_at + self._left_s(credit, front)):
                if not credit.calls:
                    self._credits.idle_again(credit)
                break
            pending = self._queues.pop(model_id)
            assert pending is not None
            started = True
            if not self._start(pending, credit, key, front):
                self._to_scheduler(pending)  # its worker was unreachable (the credit went back)
        if started:
            self._changed(model_id)

    def _left_s(self, credit: HeldCredit, front: bool) -> float:
        """How long after its running call started the credit's worker gets to a call sent now:
        after the running call and the earlier fronts (`front`), or after every call there."""
        service = self._service.get(credit.model_id)
        if not credit.calls or service is None:
            return 0.0
        ahead = 1 + len(credit.fronts) if front else len(credit.calls)
        return ahead * service.mean / 1000.0

    def _room(self, model_id: str, key: SortKey) -> tuple[HeldCredit | None, bool]:
        """The credit the call ranked `key` goes on, and whether to the front of its worker's queue."""
        credit = self._take(model_id)
        if credit is not None:
            return credit, False
        stage = self._queues.stage(model_id)
        service = self._service.get(model_id)
        if not stage or service is None or not service.steady(_STEADY_FLOOR_MS):
            return None, False
        scheduler = self._scheduler
        busy = self._credits.busy(model_id, connected=scheduler.connected, session=scheduler.session)
        room = [c for c in busy if len(c.calls) - len(c.fronts) <= stage]
        if room:
            return min(room, key=lambda c: len(c.calls)), False
        if sum(len(c.fronts) for c in busy) >= MAX_FRONTS:
            return None, False
        behind = [
            (staged, c) for c in busy if (staged := c.least_urgent_staged()) is not None and staged > key
        ]
        if not behind:
            return None, False
        return max(behind, key=lambda sc: sc[0])[1], True

    def remove(self, request_id: str) -> P | None:
        """Take a waiting call out (its caller went away); None if it is not waiting here."""
        pending = self._queues.remove(request_id)
        if pending is not None:
            self._changed(pending.call.model_id)
        return pending

    def hand_over(self, model_id: str) -> None:
        """The model's last usable credit is gone: its waiting calls go to the scheduler, in order."""
        if not (self._queues.waiting(model_id) or self._queues.accepts(model_id)):
            return
        scheduler = self._scheduler
        if self._credits.live(model_id, connected=scheduler.connected, session=scheduler.session):
            return
        self._queues.configure(model_id, None)
        waiting = self._queues.take_all(model_id)
        if waiting:
            self._changed(model_id)
        for pending in waiting:
            self._to_scheduler(pending)

    def expire(self) -> None:
        """Answer `expired` to the waiting calls whose deadline has passed; re-arm the timer."""
        self._timer, self._timer_at = None, math.inf
        expired = self._queues.expired()
        for pending, message in expired:
            self._fail(pending, ExpiredError(message))
        for model_id in {pending.call.model_id for pending, _ in expired}:
            self._changed(model_id)
        self._arm()

    def forget_silent_clients(self) -> None:
        self._queues.forget_silent_clients()
        horizon = self._clock.monotonic() - _SILENT_S
        for model_id, cadences in list(self._cadences.items()):
            cadences.forget(horizon)
            if not cadences.clients:
                del self._cadences[model_id]

    def close(self) -> None:
        for timer in self._holds.values():
            timer.cancel()
        self._holds.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, math.inf

    def running(self, model_id: str, delta: int) -> None:
        """A call started (+1) or ended (-1) on one of the model's credits."""
        self._count(model_id, delta)

    def report_demand(self) -> None:
        """Tell the scheduler the demand of each model that had calls since the last report (called
        a few times a share period, so that a share follows a gateway's load)."""
        for model_id, demand in self._demand.items():
            if demand[0] or demand[2]:
                self._report(model_id)

    def _count(self, model_id: str, delta: int) -> None:
        now = self._clock.monotonic()
        demand = self._demand.get(model_id)
        if demand is None:
            demand = self._demand[model_id] = [0, now, 0.0]
        demand[2] += demand[0] * (now - demand[1])
        demand[0] += delta
        demand[1] = now

    def _changed(self, model_id: str) -> None:
        """The model's local depth changed: count it in the demand, tell the scheduler (it counts
        it in the model's queue depth)."""
        waiting = self._queues.waiting(model_id)
        self._count(model_id, waiting - self._waiting.get(model_id, 0))
        self._waiting[model_id] = waiting
        self._report(model_id)

    def _report(self, model_id: str) -> None:
        self._count(model_id, 0)
        demand = self._demand[model_id]
        outstanding_s, demand[2] = demand[2], 0.0
        self._scheduler.report_local_depth(model_id, self._queues.waiting(model_id), outstanding_s)

    def _arm(self) -> None:
        deadline = self._queues.next_deadline()
        if deadline is None or deadline >= self._timer_at:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # (a unit test without a loop calls expire itself)
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = deadline
        self._timer = loop.call_later(max(0.0, deadline - self._clock.monotonic()), self.expire)


def _late(
    due: list[tuple[float, float, float]], free: float, run_s: float, path_s: float, margin_s: float
) -> bool:
    """Some of the calls `due` (when each reaches the gateway, its client's budget), served in
    arrival order once the slot is free at `free`, is answered past its budget. A call reaches
    its worker half a `path_s` (gateway -> worker -> gateway) after the gateway, and its client
    half a path before; its answer reaches the client a path after its run."""
    half = path_s / 2
    for at, budget_s, _ in due:
        free = max(free, at + half) + run_s
        if free + path_s + margin_s > at - half + budget_s:
            return True
    return False
