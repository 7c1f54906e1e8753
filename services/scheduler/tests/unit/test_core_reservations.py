"""Reservations in the core: a slot is kept free for a more urgent client's predicted request
only when granting the head would make that request late, never longer than the prediction,
and never for a request the ordering would put behind the head.

The overload tests replay the overload benchmark's workload (bench/scheduler_overload.py)
on a fake clock: one worker running the `sleep` model (10.3 ms, max_inflight 1, lookahead 1),
two priority-0 clients with a 30 ms budget 5 ms apart, six priority-2 clients with a 200 ms
timeout, all sending every 40 ms (twice the capacity), 1 ms on each path."""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest

from loadmaster.common.ordering import make_ordering
from loadmaster.scheduler.config import ModelPolicy
from loadmaster.scheduler.domain import Grant, OverflowPolicy, Reject, Request, RequestInfo
from loadmaster.scheduler.lookahead import Timing
from loadmaster.scheduler.reservations import Hold, Reservations

if TYPE_CHECKING:
    from conftest import Harness, MakeHarness

MS = 0.001
PATH_S = 1 * MS  # each hop: client -> scheduler, grant -> worker, worker -> scheduler and client
PERIOD_S = 40 * MS
P0_BUDGET_MS = 30.0
URGENT_BUDGET_MS = 15.0
URGENT_SEEN = 20  # requests until the urgent client's cadence is steady (its deviation has decayed)
MAX_STEPS = 100_000  # events and timer wake-ups of one replay (8 s of the workload: ~20,000)


def policy(*, reservation: bool) -> ModelPolicy:
    return ModelPolicy(1000, 5000.0, OverflowPolicy.DROP_OLDEST, lookahead=1, reservation=reservation)


@dataclass
class Overload:
    """A discrete-event replay: the core on a fake clock, a worker that queues what it is granted
    (a `front` grant ahead of what waits) and runs one request at a time."""

    h: Harness
    service_s: float = 10.3 * MS
    path_s: float = PATH_S
    stall: float = 0.0  # chance that a hop stalls 3 ms (CPU contention)
    jitter_s: float = 0.3 * MS  # each hop takes up to this much longer
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    events: list[tuple[float, int, str, object]] = field(default_factory=list)
    sent: dict[str, tuple[str, float]] = field(default_factory=dict)  # request -> (client, sent at)
    answers: dict[str, tuple[float, bool]] = field(default_factory=dict)  # request -> (latency, ok)
    waiting: list[Grant] = field(default_factory=list)  # at the worker
    running: bool = False
    seq: itertools.count[int] = field(default_factory=itertools.count)
    seen: int = 0  # outcomes of the harness already handled

    def at(self, t: float, kind: str, data: object) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, data))

    def hop(self) -> float:
        """One hop's time: the path, its jitter, and now and then a stall."""
        stall = 3 * MS if self.stall and self.rng.random() < self.stall else 0.0
        return self.path_s + self.rng.uniform(0.0, self.jitter_s) + stall

    def client(
        self, client_id: str, phase_s: float, priority: int, timeout_ms: float, seconds: float
    ) -> None:
        t0 = self.h.clock.monotonic()
        for n in range(int(seconds / PERIOD_S)):
            self.at(t0 + phase_s + n * PERIOD_S, "send", (client_id, n, priority, timeout_ms))

    def run(self, until: float) -> None:
        h = self.h
        for _ in range(MAX_STEPS):
            if not self.events:
                return
            wake = h.core.next_deadline()
            t = self.events[0][0]
            if wake is not None and wake < t:
                h.clock.advance(max(0.0, wake - h.clock.monotonic()))
                h.core.expire_due()
                self._outcomes()
                continue
            if t > until:
                return
            t, _, kind, data = heapq.heappop(self.events)
            h.clock.advance(max(0.0, t - h.clock.monotonic()))
            self._event(kind, data)
            self._outcomes()
        raise AssertionError(
            f"the replay did not end within {MAX_STEPS} steps (a timer that never moves on?)"
        )

    def _event(self, kind: str, data: object) -> None:
        h, now = self.h, self.h.clock.monotonic()
        if kind == "send":
            client_id, n, priority, timeout_ms = data  # type: ignore[misc]
            request_id = f"{client_id}/{n}"
            self.sent[request_id] = (client_id, now)
            self.at(now + self.hop(), "arrive", (request_id, client_id, priority, timeout_ms))
        elif kind == "arrive":
            request_id, client_id, priority, timeout_ms = data  # type: ignore[misc]
            info = RequestInfo(request_id, "m", client_id=client_id, priority=priority, timeout_ms=timeout_ms)
            h.enqueue_batch([info])
        elif kind == "grant":
            grant: Grant = data  # type: ignore[assignment]
            if grant.front:
                self.waiting.insert(0, grant)
            else:
                self.waiting.append(grant)
            self._start(now)
        elif kind == "done":
            grant = data  # type: ignore[assignment]
            self.running = False
            self.at(now + self.hop(), "complete", grant)
            self._answer(grant.request_id, now + self.hop(), ok=True)
            self._start(now)
        elif kind == "complete":
            grant = data  # type: ignore[assignment]
            h.complete(grant.request_id, inference_ms=self.service_s / MS)

    def _start(self, now: float) -> None:
        while not self.running and self.waiting:
            grant = self.waiting.pop(0)
            if grant.deadline_unix_ns / 1e9 < self.h.clock.time():  # the worker refuses it
                self._answer(grant.request_id, now + self.hop(), ok=False)
                self.at(now + self.hop(), "complete", grant)
                continue
            self.running = True
            service = self.service_s + self.rng.uniform(-0.2 * MS, 0.2 * MS)
            self.at(now + service, "done", grant)

    def _outcomes(self) -> None:
        now = self.h.clock.monotonic()
        outcomes = self.h.outcomes[self.seen :]
        self.seen = len(self.h.outcomes)
        for _, outcome in outcomes:
            if isinstance(outcome, Grant):
                self.at(now + self.hop(), "grant", outcome)
            elif isinstance(outcome, Reject):
                self._answer(outcome.request_id, now + self.hop(), ok=False)

    def _answer(self, request_id: str, at: float, *, ok: bool) -> None:
        if request_id in self.sent and request_id not in self.answers:
            self.answers[request_id] = (at - self.sent[request_id][1], ok)

    # ---- results ---------------------------------------------------------------------

    def p0_on_time(self) -> float:
        p0 = [a for r, a in self.answers.items() if r.startswith("p0")]
        return sum(1 for latency, ok in p0 if ok and latency <= P0_BUDGET_MS * MS) / len(p0)

    def goodput_of_capacity(self, seconds: float) -> float:
        ok = sum(1 for _, good in self.answers.values() if good)
        return ok / seconds * self.service_s


def overload(
    make_harness: MakeHarness,
    *,
    reservation: bool,
    seconds: float,
    path_s: float = PATH_S,
    stall: float = 0.0,
    jitter_s: float = 0.3 * MS,
    seed: int = 7,
) -> Overload:
    budgets = {"p0-0": P0_BUDGET_MS, "p0-1": P0_BUDGET_MS}
    h = make_harness(
        model_policy=lambda model_id: policy(reservation=reservation),
        latency_budget_ms=lambda client_id: budgets.get(client_id, 50.0),
        lookahead_margin_ms=0.5,
    )
    h.worker("w1", ["m"], ready=["m"])
    sim = Overload(h, path_s=path_s, stall=stall, jitter_s=jitter_s, rng=random.Random(seed))
    for i in range(8):
        urgent = i < 2
        client_id = f"p0-{i}" if urgent else f"p2-{i}"
        sim.client(client_id, i * 5 * MS, 0 if urgent else 2, 0.0 if urgent else 200.0, seconds + 1.0)
    start = h.clock.monotonic()
    sim.run(start + 1.0)  # warm-up: estimates and cadences settle
    warm = set(sim.sent)
    sim.answers = {r: a for r, a in sim.answers.items() if r not in warm}
    sim.sent = {r: s for r, s in sim.sent.items() if r not in warm}
    sim.run(start + seconds + 2.0)
    h.check()
    return sim


def test_overload_priority_0_is_on_time_with_reservations_and_goodput_holds(
    make_harness: MakeHarness,
) -> None:
    """1.5 ms per hop (about the overload benchmark's paths), and 2 % of hops stall 3 ms."""
    paths = {"seconds": 4.0, "path_s": 1.5 * MS, "stall": 0.02}
    without = overload(make_harness, reservation=False, **paths)
    held = overload(make_harness, reservation=True, **paths)
    assert without.p0_on_time() < 0.95  # the non-preemptive wait behind a priority-2 request
    assert held.p0_on_time() >= 0.97
    assert held.goodput_of_capacity(4.0) >= without.goodput_of_capacity(4.0) - 0.02


@pytest.fixture
def h(make_harness: MakeHarness) -> Harness:
    return taught(make_harness, reservation=True)


def taught(make_harness: MakeHarness, *, reservation: bool) -> Harness:
    """One worker, "m" (max_inflight 1, lookahead 1), taught a steady 10 ms inference with 1 ms
    paths, and a priority-0 client "urgent" (15 ms budget) seen every 40 ms: its requests are
    on time if they start within 3 ms of arriving at the scheduler."""
    h = make_harness(
        model_policy=lambda model_id: policy(reservation=reservation),
        latency_budget_ms=lambda client_id: URGENT_BUDGET_MS if client_id == "urgent" else 50.0,
    )
    h.worker("w1", ["m"], ready=["m"])
    for n in range(40):
        h.enqueue_batch([RequestInfo(f"warm-{n}", "m")])
        h.advance(12 * MS)
        h.complete(f"warm-{n}", inference_ms=10.0)
    seen_urgent(h)
    return h


def seen_urgent(h: Harness) -> None:
    """The urgent client sends every 40 ms; returns 12 ms after its last request (answered)."""
    for n in range(URGENT_SEEN):
        if n:
            h.advance(PERIOD_S - 12 * MS)
        send(h, f"u{n}", "urgent", 0)
        h.advance(12 * MS)
        h.complete(f"u{n}", inference_ms=10.0)


def before_next(h: Harness, ms: float) -> None:
    """Advance to `ms` before the urgent client's next request (after `seen_urgent`)."""
    h.advance(PERIOD_S - 12 * MS - ms * MS)


def send(h: Harness, request_id: str, client_id: str, priority: int) -> None:
    h.enqueue_batch([RequestInfo(request_id, "m", client_id=client_id, priority=priority)])


def test_a_slot_is_held_for_a_predicted_urgent_request_and_given_to_it(h: Harness) -> None:
    before_next(h, 5)  # a 10 ms request granted now would delay it ~6 ms
    send(h, "low", "background", 2)
    assert "low" not in h.granted_ids()
    hold = h.core.next_deadline()
    assert hold is not None and hold - h.clock.monotonic() < 10 * MS  # less than a service time
    h.advance(4.9 * MS)
    send(h, "u5", "urgent", 0)
    assert h.granted_ids()[-1] == "u5"  # the held slot went to it at once


def test_a_hold_lapses_when_the_urgent_client_does_not_come(h: Harness) -> None:
    before_next(h, 5)
    send(h, "low", "background", 2)
    assert "low" not in h.granted_ids()
    h.advance(10 * MS)  # past the predicted arrival and its grace: nobody came
    assert h.granted_ids()[-1] == "low"
    h.complete("low", inference_ms=10.0)
    h.advance(30 * MS)
    send(h, "low2", "background", 2)  # the next prediction (from the last arrival) has passed too
    assert h.granted_ids()[-1] == "low2"


def test_no_hold_when_the_urgent_request_is_far_enough_away(h: Harness) -> None:
    before_next(h, 20)  # the low one ends well before it
    send(h, "low", "background", 2)
    assert h.granted_ids()[-1] == "low"


def test_no_hold_for_a_head_of_the_same_priority(h: Harness) -> None:
    before_next(h, 5)
    send(h, "peer", "other-urgent", 0)
    assert h.granted_ids()[-1] == "peer"


def test_no_hold_without_reservations(make_harness: MakeHarness) -> None:
    h = taught(make_harness, reservation=False)
    before_next(h, 5)
    send(h, "low", "background", 2)
    assert h.granted_ids()[-1] == "low"


def test_an_aged_head_is_not_held() -> None:
    """A priority-2 request that waited past the deadline family's aging bound is ordered
    before the urgent client's next request: holding the slot would not serve that one first."""
    ordering = make_ordering("model_deadline")
    reservations = Reservations()
    timing = Timing(inference_s=10 * MS, one_way_s=1 * MS, jitter_s=0.2 * MS)
    arrival = itertools.count()
    t = 0.0
    for n in range(URGENT_SEEN):  # the urgent client, every 40 ms
        t = n * PERIOD_S
        urgent = request(f"u{n}", "urgent", 0, t, next(arrival), budget_ms=URGENT_BUDGET_MS)
        ordering.key(urgent)
        reservations.arrived(urgent, t)
    now = t + PERIOD_S - 5 * MS  # the next urgent one is due in 5 ms

    def hold(client_id: str, enqueued_at: float) -> Hold | None:
        head = request(f"{client_id}-1", client_id, 2, enqueued_at, next(arrival), budget_ms=50.0)
        return reservations.hold_until(
            head,
            ordering.key(head),
            places=[now],
            timing=timing,
            now=now,
            predicted_key=ordering.predicted_key,
            queued=lambda client_id: False,
        )

    fresh = hold("recent", now - 50 * MS)
    assert fresh is not None and fresh.client_id == "urgent"
    assert now < fresh.until < now + 10 * MS
    assert hold("aged", now - 300 * MS) is None  # its virtual deadline is before the urgent one's


def request(
    request_id: str, client_id: str, priority: int, at: float, arrival: int, *, budget_ms: float
) -> Request:
    info = RequestInfo(request_id, "m", client_id=client_id, priority=priority)
    return Request((1, request_id), info, arrival, at, at + 5.0, 0, budget_ms, PERIOD_S / MS)


def test_every_request_is_answered_under_holds(make_harness: MakeHarness) -> None:
    sim = overload(make_harness, reservation=True, seconds=2.0)
    assert sim.sent and set(sim.answers) == set(sim.sent)


def test_a_hold_whose_head_is_cancelled_leaves_no_timer_behind(h: Harness) -> None:
    """The held-for model's queue empties with no dispatch of it (the head is cancelled): the
    hold must not keep `next_deadline` at its lapsed time, or the hub's timer would fire
    at once, again and again."""
    before_next(h, 5)
    send(h, "low", "background", 2)
    assert "low" not in h.granted_ids()  # held
    h.cancel("low")
    h.advance(10 * MS)  # past the hold
    wake = h.core.next_deadline()
    assert wake is None or wake > h.clock.monotonic()  # nothing due now: the timer rests
