"""Timed lookahead: a busy slot's next request is granted just before the slot frees.

With `max_inflight` requests running on a worker's slot for a model, the next grant
normally waits for a Complete: worker -> gateway -> scheduler, then Grant -> gateway ->
worker, milliseconds in which the model sits idle (3 ms median measured under the
overload benchmark on our 2-core machines: a quarter of a 10 ms model's capacity). With
`lookahead` n, the scheduler predicts when the running requests end and, shortly before
the first does, lets the slot take up to n more grants; the worker queues them and starts
each the moment the one before it ends.

    predicted end = start + EWMA(the model's inference_ms, from Completes)
    start         = grant time + send time          a slot with room: starts on arrival
                  = Complete time - reply time      a staged request, once the one before ends
    send time = reply time = EWMA(grant-to-Complete - inference_ms) / 2, from requests that
                             started on arrival
    jitter    = EWMA deviation of inference_ms + that of the send and reply paths (RTTVAR)
    window opens  = earliest predicted end of the running requests - lead,
                    lead = send time + margin + 2 x jitter
    and closes    = at the slot's next Complete (the staged request is running by then), or
                    once that end is a lead past (the prediction was wrong)

Only a model whose inference time is predictable gets windows: the EWMA of its samples'
distance from the mean (as TCP's RTTVAR) must stay within a quarter of the mean, or
0.5 ms. A model whose requests take 1 ms or 1.5 s depending on the input never stages a
request behind a long one.
The price: a staged request is committed up to `send time + margin` before its slot
frees. So that a more urgent request arriving in that window does not run a service time
later, it may go to the front of the worker's queue (`front_target`, Grant.front_of_queue):
once per slot and staged request, while the running one is predicted to run on (the staged
one has not started), the worker runs it before the staged one. A staged request that this
pushes past its deadline is doomed: the worker will answer it `expired` without running it,
so the slot's next window takes one more grant, or the slot would idle behind the refusal.

A head is granted only if it is predicted to start before its deadline by more than the
send path's deviation (starting on arrival), or by more than the jitter when it has to wait
for the requests running and staged ahead of it; otherwise it is answered `expired` at once
(`too_late`): under overload the oldest requests
sit at the brink of their deadlines, and one refused at the worker costs the slot a turn.

Plain bookkeeping on the core's clock. The core grants, and opens a window by setting the
slot's `GrantCandidate.ahead`; this module only says when.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from loadmaster.common.ordering import SortKey
from loadmaster.scheduler.domain import RequestKey

__all__ = ["Lookahead", "Timing"]

_ALPHA = 0.2  # weight of the newest sample in the EWMAs
_BETA = 0.25  # weight of the newest sample in the deviation (RFC 6298's)
_STEADY = 0.25  # predictable: deviation <= this share of the mean inference time ...
_STEADY_FLOOR_S = 0.0005  # ... or this little


@dataclass(slots=True)
class _Estimates:
    inference_s: float | None = None
    deviation_s: float = 0.0  # EWMA of |sample - inference_s|
    overhead_s: float | None = None  # grant-to-Complete minus inference: the send and reply paths
    overhead_deviation_s: float = 0.0  # EWMA of |sample - overhead_s|

    def learn(self, inference_s: float, cycle_s: float | None) -> None:
        if self.inference_s is None:
            self.inference_s, self.deviation_s = inference_s, inference_s / 2
        else:
            self.deviation_s += _BETA * (abs(inference_s - self.inference_s) - self.deviation_s)
            self.inference_s += _ALPHA * (inference_s - self.inference_s)
        if cycle_s is not None:
            overhead_s = max(0.0, cycle_s - inference_s)
            if self.overhead_s is not None:
                self.overhead_deviation_s += _BETA * (
                    abs(overhead_s - self.overhead_s) - self.overhead_deviation_s
                )
            self.overhead_s = _ewma(self.overhead_s, overhead_s)

    @property
    def one_way_s(self) -> float:
        """The send (or reply) path: half of grant-to-Complete minus inference; 0 unmeasured."""
        return self.overhead_s / 2 if self.overhead_s is not None else 0.0

    @property
    def jitter_s(self) -> float:
        """How far a predicted start may be off: the deviations of both of its parts."""
        return self.deviation_s + self.overhead_deviation_s

    @property
    def inference_or_0_s(self) -> float:
        return self.inference_s if self.inference_s is not None else 0.0

    @property
    def predictable(self) -> bool:
        return (
            self.inference_s is not None
            and self.overhead_s is not None
            and self.deviation_s <= max(_STEADY_FLOOR_S, _STEADY * self.inference_s)
        )


@dataclass(frozen=True, slots=True)
class Timing:
    """A predictable model's measured times (see `Lookahead.timing`)."""

    inference_s: float
    one_way_s: float  # the send path, and the reply path
    jitter_s: float  # how far a predicted start may be off


@dataclass(slots=True)
class _Slot:
    """One worker's slot for one model."""

    max_inflight: int
    running: dict[RequestKey, float] = field(default_factory=dict)  # request -> predicted end
    staged: list[RequestKey] = field(default_factory=list)  # granted beyond max_inflight, in order
    staged_keys: dict[RequestKey, SortKey] = field(default_factory=dict)  # their place in the queue
    deadlines: dict[RequestKey, float] = field(default_factory=dict)  # of the staged ones
    # Staged requests a front grant pushed past their deadline: the worker will answer them
    # `expired` without running them, so they hold no place in the slot's queue.
    doomed: set[RequestKey] = field(default_factory=set)
    granted_at: dict[RequestKey, float] = field(default_factory=dict)  # started on arrival
    open: bool = False
    front_used: bool = False  # a request went ahead of the staged ones since the last Complete


class Lookahead:
    def __init__(self, *, margin_s: float = 0.0005) -> None:
        self._margin_s = margin_s
        # model -> worker -> slot: dispatch asks per model, so it never walks other models' slots
        self._slots: dict[str, dict[str, _Slot]] = {}
        self._estimates: dict[str, _Estimates] = {}
        self._where: dict[RequestKey, tuple[str, str]] = {}

    def granted(
        self,
        worker_id: str,
        model_id: str,
        key: RequestKey,
        now: float,
        *,
        max_inflight: int,
        sort_key: SortKey = (),
        deadline: float = math.inf,
        front: bool = False,
    ) -> None:
        slots = self._slots.setdefault(model_id, {})
        slot = slots.get(worker_id)
        if slot is None:
            slot = slots[worker_id] = _Slot(max_inflight)
        slot.max_inflight = max_inflight
        self._where[key] = (worker_id, model_id)
        if len(slot.running) < max_inflight:
            estimates = self._estimates.get(model_id) or _Estimates()
            slot.running[key] = now + estimates.one_way_s + estimates.inference_or_0_s
            slot.granted_at[key] = now
        elif front:
            slot.staged.insert(0, key)
            slot.staged_keys[key] = sort_key
            slot.deadlines[key] = deadline
            slot.front_used = True
            self._doom_late(model_id, slot, now)
        else:
            slot.staged.append(key)
            slot.staged_keys[key] = sort_key
            slot.deadlines[key] = deadline

    def _doom_late(self, model_id: str, slot: _Slot, now: float) -> None:
        """After a front grant: the staged requests it pushes past their deadlines are doomed.
        The worker will answer them `expired` the moment their turn comes, so the slot may
        stage as many others behind them (`doomed`), or it would idle until their Completes."""
        estimates = self._estimates.get(model_id) or _Estimates()
        for key, start in self._starts(model_id, slot, now)[0].items():
            if slot.deadlines.get(key, math.inf) < start + estimates.jitter_s:
                slot.doomed.add(key)

    def completed(self, key: RequestKey, now: float, *, inference_ms: float) -> tuple[str, str] | None:
        """A granted request finished; returns its (worker, model) when that slot's window closed."""
        where = self._where.pop(key, None)
        if where is None:
            return None
        slot = self._slots[where[1]][where[0]]
        if key in slot.doomed:  # answered without running, as predicted: nothing to learn or close
            slot.doomed.discard(key)
            self._unstage(slot, key)
            self._drop_if_idle(*where)
            return None
        granted_at = slot.granted_at.pop(key, None)
        estimates = self._estimates.setdefault(where[1], _Estimates())
        if inference_ms > 0.0:
            estimates.learn(inference_ms / 1000.0, None if granted_at is None else now - granted_at)
        if slot.running.pop(key, None) is None:
            self._unstage(slot, key)  # failed before it ran (expired, refused at the door)
        reply_s, inference_s = estimates.one_way_s, estimates.inference_or_0_s
        while slot.staged and len(slot.running) < slot.max_inflight:
            # it started when the finished one ended, a reply path before this Complete
            started = slot.staged[0]
            self._unstage(slot, started)
            if started not in slot.doomed:
                slot.running[started] = now - reply_s + inference_s
        was_open, slot.open = slot.open, False
        slot.front_used = False
        self._drop_if_idle(*where)
        return where if was_open else None

    def forget(self, key: RequestKey) -> None:
        """A granted request that will never Complete here (its session or worker is gone)."""
        where = self._where.pop(key, None)
        if where is None:
            return
        slot = self._slots[where[1]][where[0]]
        slot.running.pop(key, None)
        slot.granted_at.pop(key, None)
        slot.doomed.discard(key)
        self._unstage(slot, key)
        self._drop_if_idle(*where)

    @staticmethod
    def _unstage(slot: _Slot, key: RequestKey) -> None:
        if key in slot.staged_keys:
            slot.staged.remove(key)
            del slot.staged_keys[key]
            slot.deadlines.pop(key, None)

    def forget_worker(self, worker_id: str) -> None:
        for model_id in list(self._slots):
            slot = self._slots[model_id].pop(worker_id, None)
            if slot is not None:
                for key in (*slot.running, *slot.staged, *slot.doomed):
                    self._where.pop(key, None)
                self._drop_if_idle(worker_id, model_id)

    def _drop_if_idle(self, worker_id: str, model_id: str) -> None:
        slots = self._slots[model_id]
        slot = slots.get(worker_id)
        if slot is not None and not slot.running and not slot.staged and not slot.doomed:
            del slots[worker_id]
        if not slots:
            del self._slots[model_id]

    @property
    def active(self) -> bool:
        """Some slot is tracked (a model with lookahead has requests granted)."""
        return bool(self._slots)

    def open_models(self, worker_id: str) -> list[str]:
        return [m for m, slots in self._slots.items() if (slot := slots.get(worker_id)) and slot.open]

    def too_late(
        self, worker_id: str, model_id: str, deadline: float, now: float, *, front: bool = False
    ) -> bool:
        """A request granted to this slot now would start only after `deadline`, give or take:
        after the send time (within its deviation), and, when it has to wait at the worker
        (staged, or ahead of the staged ones when `front`), after the requests running and
        staged before it (within the inference time's deviation too)."""
        estimates = self._estimates.get(model_id) or _Estimates()
        arrival = now + estimates.one_way_s
        slot = self._slots.get(model_id, {}).get(worker_id)
        following = now
        if slot is not None:
            if not front:
                following = self._starts(model_id, slot, now)[1][0]
            elif len(slot.running) >= slot.max_inflight:
                following = min(slot.running.values())
        if following <= arrival:  # starts on arrival: only the send path can make it late
            return deadline < arrival + estimates.overhead_deviation_s
        return deadline < following + estimates.jitter_s

    def _starts(
        self, model_id: str, slot: _Slot, now: float, *, floor: float = -math.inf
    ) -> tuple[dict[RequestKey, float], list[float]]:
        """Predicted start of each staged request (the doomed never run), and the slot's places
        after them (a heap: the first is when one more would start): each staged request takes
        the first of the slot's `max_inflight` places to free (a free place: `now`; a running
        request predicted to end before `floor`: `floor`)."""
        estimates = self._estimates.get(model_id)
        inference_s = estimates.inference_or_0_s if estimates is not None else 0.0
        places = sorted(max(end, floor) for end in slot.running.values())[: slot.max_inflight]
        places += [now] * (slot.max_inflight - len(places))
        heapq.heapify(places)
        starts: dict[RequestKey, float] = {}
        for key in slot.staged:
            if key not in slot.doomed:
                starts[key] = start = heapq.heappop(places)
                heapq.heappush(places, start + inference_s)
        return starts, places

    def inference_s(self, model_id: str) -> float | None:
        """The model's measured inference time (an EWMA), predictable or not; None unmeasured."""
        estimates = self._estimates.get(model_id)
        return estimates.inference_s if estimates is not None else None

    def learn_inference(self, model_id: str, inference_s: float) -> None:
        """An inference time measured outside a grant (runs on a dispatch credit)."""
        if inference_s > 0.0:
            self._estimates.setdefault(model_id, _Estimates()).learn(inference_s, None)

    def timing(self, model_id: str) -> Timing | None:
        """The model's inference time, one-way path and jitter, once they are predictable."""
        estimates = self._estimates.get(model_id)
        if estimates is None or not estimates.predictable:
            return None
        return Timing(estimates.inference_or_0_s, estimates.one_way_s, estimates.jitter_s)

    def places(self, model_id: str, workers: Iterable[tuple[str, int]], now: float) -> list[float]:
        """When each place of `model_id` on `workers` ((worker, max_inflight) pairs) is predicted
        to take its next request: a free place now, a busy one when its running request ends,
        or, with requests staged on the slot, once they have run too."""
        slots = self._slots.get(model_id, {})
        frees: list[float] = []
        for worker_id, max_inflight in workers:
            slot = slots.get(worker_id)
            frees += [now] * max_inflight if slot is None else self._starts(model_id, slot, now, floor=now)[1]
        return frees

    def doomed(self, worker_id: str, model_id: str) -> int:
        """Staged requests of this slot that will be refused, not run (see `_doom_late`)."""
        slot = self._slots.get(model_id, {}).get(worker_id)
        return len(slot.doomed) if slot is not None else 0

    def front_target(self, model_id: str, sort_key: SortKey, now: float) -> str | None:
        """A worker where a request of `model_id` with `sort_key` may go to the front of the queue:
        a slot whose next staged request is less urgent, has not started (the running one is
        predicted to run on), and has not been passed yet since the slot's last Complete."""
        estimates = self._estimates.get(model_id)
        if estimates is None or not estimates.predictable:
            return None
        # The front grant must reach the worker before the staged request starts: one that
        # arrives after it queues ahead of whatever waits there then, possibly an earlier
        # front grant, which then runs a service time late.
        arrives = now + estimates.one_way_s + estimates.jitter_s
        for worker_id, slot in self._slots.get(model_id, {}).items():
            if (
                slot.staged
                and not slot.front_used
                and slot.running
                and min(slot.running.values()) > arrives
                and slot.staged_keys.get(slot.staged[0], ()) > sort_key
            ):
                return worker_id
        return None

    def is_open(self, worker_id: str, model_id: str) -> bool:
        slot = self._slots.get(model_id, {}).get(worker_id)
        return slot is not None and slot.open

    def next_open(self, models: Iterable[str], now: float) -> float | None:
        """The earliest time a closed window opens for a slot of one of `models` (the models
        with waiters: a window nobody would use is not worth a wake-up). A window whose
        prediction has passed waits for the slot's Complete; an open one closes by time at
        the next dispatch (`update`), no wake-up needed."""
        wake: float | None = None
        for model_id in models:
            for slot in self._slots.get(model_id, {}).values():
                if slot.open:
                    continue
                window = self._window(model_id, slot)
                if window is not None and window[1] >= now and (wake is None or window[0] < wake):
                    wake = window[0]
        return wake

    def update(self, model_id: str, now: float) -> tuple[list[str], list[str]]:
        """Open the windows of `model_id`'s slots that are due and close those whose prediction
        has passed; returns (workers opened, workers closed)."""
        opened: list[str] = []
        closed: list[str] = []
        for worker_id, slot in self._slots.get(model_id, {}).items():
            window = self._window(model_id, slot)
            due = window is not None and window[0] <= now <= window[1]
            if due and not slot.open:
                slot.open = True
                opened.append(worker_id)
            elif slot.open and not due:
                slot.open = False
                closed.append(worker_id)
        return opened, closed

    def _window(self, model_id: str, slot: _Slot) -> tuple[float, float] | None:
        if len(slot.running) < slot.max_inflight or not slot.running:
            return None  # a slot with room takes grants anyway
        estimates = self._estimates.get(model_id)
        if estimates is None or not estimates.predictable:
            return None  # nothing measured yet, or too variable to predict
        # how early a grant must go to arrive before the end: the send time, the margin, and
        # twice the predictions' jitter (the send path stalls by milliseconds under CPU contention)
        lead = estimates.one_way_s + self._margin_s + 2.0 * estimates.jitter_s
        end = min(slot.running.values())
        return end - lead, end + lead


def _ewma(previous: float | None, sample: float) -> float:
    return sample if previous is None else previous + _ALPHA * (sample - previous)
