"""Reservations: a slot is held, briefly, for a more urgent client that is about to send.

Under overload a model's queue is never empty, so a slot that frees goes at once to the
head of the queue. If that head is a priority-2 request and a priority-0 client's next
observation reaches the scheduler a millisecond later, the priority-0 request waits a whole
service time behind it: the blind spot of non-preemptive scheduling. Measured on the
overload benchmark (`sleep` 10 ms, two priority-0 clients with a 30 ms budget, 5 ms apart),
that wait is what made 4-8 % of their answers late. Robots send at a steady cadence and the
scheduler already measures it, so it can see the next one coming.

Before a head is granted, `Reservations.hold_until` predicts, for every client of the model
with a strictly more urgent priority and a steady cadence, its next request:

    arrives    a = its last arrival + the EWMA of its inter-arrival time (this model's)
    is due by  a + its latency budget - send path     (its budget runs from when it sent:
                                                        about one send path earlier)
    and plays the model's places forward (each place: when it frees, as the lookahead
    predicts it) twice, with the head granted and without it: each predicted request, in
    arrival order, takes the first place to free, starts a send path after both, runs the
    model's inference time and is answered a reply path later. It counts as late when that
    answer is due within the margin (jitter + `lookahead_margin_ms`) of its deadline.

If the head makes a predicted request late that would not be late without it, the head is
not granted: the slot stays free until that request's arrival (plus its arrival jitter),
and the arrival's own dispatch grants it the slot. A client that does not come by then is
not waited for again until it sends (its predicted arrival has passed), so a hold lasts at
most one prediction, and never past the time the head would have ended had it been granted:
a place idles at most one service time for it.

Only a request that would be ordered before the head if it were already queued is waited
for (the ordering's `predicted_key`): a head that aged past the priority-0 requests (the
deadline family's starvation bound) is granted as if no reservation existed. Orderings that
do not rank by priority (round robin, batches) never hold. A model's inference time and
paths come from the lookahead (lookahead.py): without its estimates nothing is held.

Plain bookkeeping on the core's clock; the core asks and re-arms its timer.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from loadmaster.common.ordering import SortKey
from loadmaster.scheduler.domain import Request
from loadmaster.scheduler.lookahead import Timing

__all__ = ["Hold", "Reservations"]

_ALPHA = 0.2  # weight of the newest inter-arrival sample in the EWMAs
_BETA = 0.25  # weight of the newest sample in the deviation (RFC 6298's)
_STEADY = 0.25  # periodic: deviation <= this share of the cadence
_MIN_SAMPLES = 3  # inter-arrival gaps seen before a client's cadence is trusted
_MIN_GRACE_S = 0.001  # a hold lasts at least this long past the predicted arrival
_LATEST = 1 << 62  # `arrival` of a predicted request: after every queued one


@dataclass(slots=True)
class _Stream:
    """One client's requests for one model."""

    last_at: float
    last: Request  # its latest request: what the next one will look like
    cadence_s: float | None = None
    deviation_s: float = 0.0  # EWMA of |gap - cadence_s|
    samples: int = 0

    def next_arrival(self) -> float | None:
        cadence = self.cadence_s
        if cadence is None or self.samples < _MIN_SAMPLES or self.deviation_s > _STEADY * cadence:
            return None
        return self.last_at + cadence


@dataclass(frozen=True, slots=True)
class Hold:
    until: float  # when the hold lapses (the awaited arrival, plus its jitter)
    client_id: str  # the client it waits for


class Reservations:
    def __init__(self, *, margin_s: float = 0.0005) -> None:
        self._margin_s = margin_s
        self._streams: dict[str, dict[str, _Stream]] = {}  # model -> client -> stream
        # model -> priority -> its clients: a head of the most urgent priority present (the
        # usual case) is granted without a look at any client
        self._priorities: dict[str, dict[int, int]] = {}

    def arrived(self, request: Request, now: float) -> None:
        """A request of a client reached the scheduler (queued, or run on a credit)."""
        client_id = request.info.client_id
        if not client_id:
            return
        streams = self._streams.get(request.model_id)
        if streams is None:
            streams = self._streams[request.model_id] = {}
        stream = streams.get(client_id)
        priority = request.info.priority
        if stream is None:
            streams[client_id] = _Stream(now, request)
            self._count(request.model_id, priority, 1)
            return
        if stream.last.info.priority != priority:
            self._count(request.model_id, stream.last.info.priority, -1)
            self._count(request.model_id, priority, 1)
        gap = max(0.0, now - stream.last_at)
        if stream.cadence_s is None:
            stream.cadence_s, stream.deviation_s = gap, gap / 2
        else:
            stream.deviation_s += _BETA * (abs(gap - stream.cadence_s) - stream.deviation_s)
            stream.cadence_s += _ALPHA * (gap - stream.cadence_s)
        stream.samples += 1
        stream.last_at, stream.last = now, request

    def forget_client(self, client_id: str) -> None:
        for model_id in list(self._streams):
            streams = self._streams[model_id]
            stream = streams.pop(client_id, None)
            if stream is not None:
                self._count(model_id, stream.last.info.priority, -1)
            if not streams:
                del self._streams[model_id]

    def _count(self, model_id: str, priority: int, change: int) -> None:
        counts = self._priorities.setdefault(model_id, {})
        counts[priority] = counts.get(priority, 0) + change
        if not counts[priority]:
            del counts[priority]
            if not counts:
                del self._priorities[model_id]

    def may_hold(self, model_id: str, priority: int) -> bool:
        """Some client of `model_id` sends at a more urgent priority than `priority`."""
        counts = self._priorities.get(model_id)
        return counts is not None and min(counts) < priority

    def hold_until(
        self,
        head: Request,
        head_key: SortKey,
        *,
        places: Iterable[float],
        timing: Timing,
        now: float,
        predicted_key: Callable[[Request], SortKey | None],
        queued: Callable[[str], bool],
    ) -> Hold | None:
        """Whether granting `head` now (to the first of `places` to free) would make a more
        urgent client's predicted request late that would otherwise be on time; if so, until
        when to hold the slot for it. `queued(client)`: the client has a request waiting for
        this model already (its next one then does not come first)."""
        streams = self._streams.get(head.model_id)
        if not streams:
            return None
        frees = sorted(places)
        if not frees:
            return None
        inference, send = timing.inference_s, timing.one_way_s
        start = max(frees[0], now + send)
        ends = start + inference
        expected: list[tuple[float, float, str]] = []  # (arrival, due by, client)
        priority = head.info.priority
        for client_id, stream in streams.items():
            if stream.last.info.priority >= priority or client_id == head.info.client_id:
                continue
            arrival = stream.next_arrival()
            if arrival is None or arrival + self._grace(stream) <= now:
                continue  # not periodic, or late: not waited for again until it sends
            if arrival >= ends + inference * len(streams):
                continue  # beyond any chain of waits the head could start
            if queued(client_id):
                continue
            predicted = replace(stream.last, enqueued_at=arrival, arrival=_LATEST, backlog=0)
            key = predicted_key(predicted)
            if key is None or key > head_key:
                continue  # the head goes first even if it were here
            expected.append((arrival, arrival + stream.last.budget_ms / 1000.0 - send, client_id))
        if not expected:
            return None
        expected.sort()
        slack = timing.jitter_s + self._margin_s
        with_head = [ends, *frees[1:]]
        late = self._late(with_head, expected, timing, slack)
        if late:
            late -= self._late(frees, expected, timing, slack)
        if not late:
            return None
        arrival, _, client_id = min(e for e in expected if e[2] in late)
        # never held past the time the head would have ended: waiting longer cannot be better
        return Hold(min(arrival + self._grace(streams[client_id]), ends), client_id)

    @staticmethod
    def _late(
        places: list[float], expected: list[tuple[float, float, str]], timing: Timing, slack: float
    ) -> set[str]:
        """The clients whose predicted request is answered too late, `places` given."""
        heap = list(places)
        heapq.heapify(heap)
        late: set[str] = set()
        for arrival, due, client_id in expected:
            free = heapq.heappop(heap)
            start = max(free, arrival + timing.one_way_s)
            end = start + timing.inference_s
            heapq.heappush(heap, end)
            if end + timing.one_way_s + slack > due:
                late.add(client_id)
        return late

    @staticmethod
    def _grace(stream: _Stream) -> float:
        return max(_MIN_GRACE_S, 2.0 * stream.deviation_s)
