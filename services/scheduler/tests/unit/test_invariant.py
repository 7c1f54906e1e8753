"""Random operation sequences: every admitted request ends exactly once, and the core's
counts always match what the gateway side has seen.

Each sequence runs twice: with the scheduling mechanisms as shipped (dispatch credits on,
lent with a local queue that stages the model's `lookahead` calls: CoreConfig's defaults) and
with them off. Workers run what they are granted (one request per slot at a time, ~10 ms,
1 ms each way) and report it done; with the mechanisms on, the gateways accept credits and
run requests on them. One priority-0 client sends on a steady cadence with a tight budget.
Around that, the sequences connect, lose and re-report workers, send, cancel and fail
requests, and close gateway sessions."""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from loadmaster.scheduler.domain import Grant, OverflowPolicy, SlotState
from loadmaster.v1 import errors_pb2

if TYPE_CHECKING:
    from conftest import Harness, MakeHarness

MODELS = ("m1", "m2")
WORKERS = ("w1", "w2", "w3")
STATES = (SlotState.READY, SlotState.READY, SlotState.LOADING, SlotState.IDLE)
CLIENTS = (("", 0), ("c0", 0), ("c1", 1), ("c2", 2), ("c2b", 2))  # (client id, its priority)
TICK_S = 0.1  # the steady client's period
BUDGETS_MS = {"steady": 15.0}  # its latency budget: tight, so its requests rank ahead
PATH_S = 0.001  # grant -> worker, and worker -> Complete
MAX_WAKES = 10_000  # clock stops (timer, tick, worker event) within one advance
ERRORS = (0, 0, errors_pb2.ERROR_CODE_UNAVAILABLE, errors_pb2.ERROR_CODE_INTERNAL)

MECHANISMS: dict[str, dict[str, Any]] = {
    "shipped": {},  # CoreConfig's defaults: credits on, their local queues staging 1 call
    "off": {"dispatch_credits": 0, "lookahead": 0},
}


@dataclass(order=True, slots=True)
class _Done:
    """A worker finished an attempt; its Complete reaches the scheduler at `at`."""

    at: float
    seq: int
    session: int
    request_id: str
    worker_id: str
    attempt: int
    inference_ms: float


class _Run:
    def __init__(self, h: Harness, rng: random.Random, *, credits: bool, max_inflight: int) -> None:
        self.h, self.rng, self.credits, self.max_inflight = h, rng, credits, max_inflight
        self.sessions = [1, 2]
        self.ids = itertools.count(1)
        self.next_tick: float | None = h.clock.monotonic()  # None: the steady client stopped
        self.done: list[_Done] = []  # the workers' reports to come, a heap
        self.seq = itertools.count()
        self.lanes: dict[tuple[str, str], list[float]] = {}  # (worker, model) -> when each slot frees
        self.models: dict[tuple[int, str], str] = {}  # (session, request) -> model
        self.seen = 0  # outcomes already handed to the workers
        for session in self.sessions:
            self._open(session)

    def _open(self, session: int) -> None:
        if self.credits:
            self.h.core.accept_credits(session)

    def _new_id(self) -> str:
        return f"r{next(self.ids)}"

    def step(self) -> None:
        h, rng = self.h, self.rng
        op = rng.random()
        connected = [v.hello.worker_id for v in h.core.workers()]
        if op < 0.03:
            worker_id = rng.choice(WORKERS)
            self._forget_worker(worker_id)
            h.worker(worker_id, rng.sample(MODELS, rng.randint(1, 2)))
        elif op < 0.045 and connected:
            worker_id = rng.choice(connected)
            self._forget_worker(worker_id)
            h.lose_worker(worker_id)
        elif op < 0.12 and connected:
            worker_id = rng.choice(connected)
            record = h.core._registry.get(worker_id)
            assert record is not None
            states = {m: rng.choice(STATES) for m in record.repository}
            h.report(worker_id, states, error=rng.choice(["", "", "oom"]), gen=rng.randint(1, 3))
        elif op < 0.45:
            client, priority = rng.choice(CLIENTS)
            self._enqueue(
                rng.choice((*MODELS, "unknown")),
                session=rng.choice(self.sessions),
                client=client,
                priority=priority,
                urgency=rng.random(),
                timeout_ms=rng.choice([0.0, 50.0, 500.0]),
            )
        elif op < 0.50:  # a failure reported out of turn (its worker's report is then stale)
            granted = [key for key, life in h._lives.items() if life.state == "granted"]
            if granted:
                session, request_id = rng.choice(granted)
                error = rng.choice(ERRORS[2:])
                h.complete(request_id, session=session, error=error, retryable=rng.random() < 0.7)
        elif op < 0.54:
            queued = [key for key, life in h._lives.items() if life.state == "queued"]
            if queued:
                session, request_id = rng.choice(queued)
                h.cancel(request_id, session=session)
        elif op < 0.56:
            gone = rng.choice(self.sessions)
            h.close_session(gone)
            self.sessions[self.sessions.index(gone)] = new = max(self.sessions) + 1
            self._open(new)
        elif op < 0.66:
            self._use_credit()
        elif op < 0.72 and self.next_tick is not None:  # to just before the steady client sends
            self.advance(max(0.0, self.next_tick - 0.002 - h.clock.monotonic()))
        else:
            self.advance(rng.choice([0.001, 0.003, 0.005, 0.02, 0.1, 0.3]))
        self._hand_grants_to_workers()

    def _enqueue(self, model: str, *, session: int, **info: Any) -> None:
        request_id = self._new_id()
        self.models[(session, request_id)] = model
        self.h.enqueue(request_id, model=model, session=session, **info)

    def _use_credit(self) -> None:
        """The gateway's side of credits: run on an idle one (reported before or after the
        run ended), or hand one back (a revoked one first)."""
        h, rng = self.h, self.rng
        if not h.lent:
            return
        revoked = [cid for cid in h.lent if cid in h.revoked]
        if revoked and rng.random() < 0.5:
            credit_id = rng.choice(revoked)
            h.return_credit(credit_id, session=h.lent[credit_id][0])
            return
        idle = sorted(cid for cid, (_, c) in h.lent.items() if not c.running)
        if not idle:
            return
        credit_id = rng.choice(idle)
        session, credit = h.lent[credit_id]
        client, priority = rng.choice(CLIENTS)
        request_id = self._new_id()
        self.models[(session, request_id)] = credit.model_id
        if rng.random() < 0.6:
            h.run(
                request_id,
                credit_id,
                model=credit.model_id,
                session=session,
                client=client,
                priority=priority,
            )
            self._start(session, request_id, credit.worker_id, attempt=1)
        else:
            h.finished(
                request_id,
                credit_id,
                error=rng.choice(ERRORS),
                retryable=rng.random() < 0.7,
                session=session,
                model=credit.model_id,
                client=client,
                priority=priority,
                inference_ms=rng.uniform(9.5, 10.5),
            )

    # ---- the workers -----------------------------------------------------------------

    def _hand_grants_to_workers(self) -> None:
        outcomes = self.h.outcomes
        for session, outcome in outcomes[self.seen :]:
            if isinstance(outcome, Grant):
                self._start(session, outcome.request_id, outcome.worker_id, attempt=outcome.attempt)
        self.seen = len(outcomes)

    def _start(self, session: int, request_id: str, worker_id: str, *, attempt: int) -> None:
        """The worker runs the attempt on its first free slot for the model, after those
        granted to it before."""
        lanes = self.lanes.setdefault(
            (worker_id, self.models[(session, request_id)]), [0.0] * self.max_inflight
        )
        lane = min(range(len(lanes)), key=lanes.__getitem__)
        inference_s = self.rng.uniform(0.0099, 0.0101)
        lanes[lane] = max(self.h.clock.monotonic() + PATH_S, lanes[lane]) + inference_s
        done = _Done(
            lanes[lane] + PATH_S, next(self.seq), session, request_id, worker_id, attempt, inference_s * 1000
        )
        heapq.heappush(self.done, done)

    def _forget_worker(self, worker_id: str) -> None:
        """The worker is gone (or starts over): what it was running is lost with it."""
        self.done = [d for d in self.done if d.worker_id != worker_id]
        heapq.heapify(self.done)
        self.lanes = {key: lanes for key, lanes in self.lanes.items() if key[0] != worker_id}

    def _report(self, done: _Done) -> None:
        life = self.h._lives.get((done.session, done.request_id))
        if (
            life is None
            or life.state != "granted"
            or (life.worker_id, life.attempts)
            != (
                done.worker_id,
                done.attempt,
            )
        ):
            return  # that attempt ended already (failed out of turn, or its session is gone)
        error = 0 if self.rng.random() < 0.9 else self.rng.choice(ERRORS[2:])
        self.h.complete(
            done.request_id,
            session=done.session,
            error=error,
            retryable=self.rng.random() < 0.7,
            worker=done.worker_id,
            inference_ms=done.inference_ms,
        )

    # ---- time ------------------------------------------------------------------------

    def advance(self, seconds: float, *, timer: bool | None = None) -> None:
        """Move the clock to the next thing due, as the hub's timer does (or, now and then,
        in one leap past the timer): a worker's report, the steady client's request, or the
        core's `next_deadline`."""
        h = self.h
        end = h.clock.monotonic() + seconds
        if timer is None:
            timer = self.rng.random() < 0.8
        for _ in range(MAX_WAKES):
            now = h.clock.monotonic()
            wake = h.core.next_deadline() if timer else None
            report = self.done[0].at if self.done else None
            tick = self.next_tick
            due = min(t for t in (wake, report, tick, end) if t is not None)
            if due > end:
                due = end
            h.advance(max(0.0, due - now))
            if report is not None and report <= due:
                self._report(heapq.heappop(self.done))
            elif tick is not None and tick <= due:
                self._enqueue("m1", session=self.sessions[0], client="steady", timeout_ms=30.0)
                self.next_tick = tick + TICK_S
            elif due >= end:
                self._hand_grants_to_workers()
                return
            elif self.next_tick is not None and self.rng.random() < 0.3:
                self._hand_grants_to_workers()
                return  # a timer wake-up: what comes next may arrive at once
            self._hand_grants_to_workers()
        raise AssertionError(f"the clock stopped more than {MAX_WAKES} times in {seconds} s")

    def drain(self) -> None:
        """Nothing new arrives; everything waiting expires, everything running completes,
        every credit comes back."""
        h = self.h
        self.next_tick = None
        for _ in range(10):  # a completion may lend a credit again; bounded
            self.advance(11.0, timer=True)  # past the clients' liveness checks too
            for credit_id in list(h.lent):
                h.return_credit(credit_id, session=h.lent[credit_id][0])
            if not self.done and not any(life.state == "granted" for life in h._lives.values()):
                return
        raise AssertionError("requests still running after the drain")

    def check_counts(self) -> None:
        h = self.h
        h.check()
        stats = h.core.queue_stats()
        lives = Counter(life.state for life in h._lives.values())
        assert sum(s.depth for s in stats) == lives["queued"]
        assert sum(s.inflight for s in stats) == lives["granted"]


def _harness(make_harness: MakeHarness, rng: random.Random, mechanisms: str) -> tuple[Harness, _Run]:
    max_inflight = rng.choice([1, 2])
    h = make_harness(
        max_queue_size=rng.choice([3, 50]),
        overflow_policy=rng.choice(list(OverflowPolicy)),
        max_retries=rng.choice([0, 1, 2]),
        max_inflight=lambda model_id: max_inflight,
        latency_budget_ms=lambda client_id: BUDGETS_MS.get(client_id, 50.0),
        **MECHANISMS[mechanisms],
    )
    return h, _Run(h, rng, credits=mechanisms == "shipped", max_inflight=max_inflight)


@pytest.mark.parametrize("mechanisms", list(MECHANISMS))
@pytest.mark.parametrize("seed", range(12))
def test_random_operations_keep_the_invariant(make_harness: MakeHarness, seed: int, mechanisms: str) -> None:
    h, run = _harness(make_harness, random.Random(seed), mechanisms)
    for _ in range(400):
        run.step()
        run.check_counts()
    run.drain()
    assert h.core.next_deadline() is None
    h.check(settled=True)
    if mechanisms == "off":
        assert not h.recorded["credits_lent"]
        assert not any(reject.use_share for reject in h.rejects())


def test_the_shipped_mechanisms_are_exercised(make_harness: MakeHarness) -> None:
    """The random sequences above reach every mechanism they claim to test: credits lent with
    a local queue that stages the model's lookahead, run on and revoked, and requests sent back
    to the local queue of a gateway that holds a share (`use_share`)."""
    recorded: Counter[str] = Counter()
    stages: set[int] = set()
    handed_back = 0
    for seed in range(12):
        h, run = _harness(make_harness, random.Random(seed), "shipped")
        for _ in range(400):
            run.step()
        recorded += h.recorded
        stages |= {c.local_queue.stage for _, c in h.lent.values() if c.local_queue is not None}
        handed_back += sum(1 for reject in h.rejects() if reject.use_share)
    assert recorded["credits_lent"] > 0
    assert recorded["credits_revoked"] > 0
    assert recorded["placement_decisions:credit"] > 0  # requests run on credits
    assert stages == {1}  # CoreConfig's lookahead
    assert handed_back > 0
