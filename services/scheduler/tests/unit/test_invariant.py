"""Random operation sequences: every admitted request ends exactly once, and the core's
counts always match what the gateway side has seen.

Each sequence runs twice: with the scheduling mechanisms as shipped (dispatch credits,
timed lookahead and reservations all on: CoreConfig's defaults) and with all three off.
With them on, the gateways accept credits and run requests on them, completions carry
inference times (the lookahead's estimates) and one priority-0 client sends on a steady
cadence (what a reservation waits for)."""

from __future__ import annotations

import random
from collections import Counter
from typing import TYPE_CHECKING, Any

import pytest

from loadmaster.scheduler.domain import OverflowPolicy, SlotState
from loadmaster.v1 import errors_pb2

if TYPE_CHECKING:
    from conftest import Harness, MakeHarness

MODELS = ("m1", "m2")
WORKERS = ("w1", "w2", "w3")
STATES = (SlotState.READY, SlotState.READY, SlotState.LOADING, SlotState.IDLE)
CLIENTS = (("", 0), ("c0", 0), ("c1", 1), ("c2", 2), ("c2b", 2))  # (client id, its priority)
TICK_S = 0.1  # the steady client's period
BUDGETS_MS = {"steady": 15.0}  # its latency budget: a head granted just before it makes it late
MAX_WAKES = 10_000  # timer wake-ups within one clock advance
ERRORS = (0, 0, errors_pb2.ERROR_CODE_UNAVAILABLE, errors_pb2.ERROR_CODE_INTERNAL)

MECHANISMS: dict[str, dict[str, Any]] = {
    "shipped": {},  # CoreConfig's defaults: credits, lookahead and reservations on
    "off": {"dispatch_credits": 0, "lookahead": 0, "reservation": False},
}


class _Run:
    def __init__(self, h: Harness, rng: random.Random, *, credits: bool) -> None:
        self.h, self.rng, self.credits = h, rng, credits
        self.sessions = [1, 2]
        self.count = 0
        self.next_tick = h.clock.monotonic()
        for session in self.sessions:
            self._open(session)

    def _open(self, session: int) -> None:
        if self.credits:
            self.h.core.accept_credits(session)

    def _new_id(self) -> str:
        self.count += 1
        return f"r{self.count}"

    def step(self) -> None:
        h, rng = self.h, self.rng
        op = rng.random()
        connected = [v.hello.worker_id for v in h.core.workers()]
        if op < 0.03:
            h.worker(rng.choice(WORKERS), rng.sample(MODELS, rng.randint(1, 2)))
        elif op < 0.045 and connected:
            h.lose_worker(rng.choice(connected))
        elif op < 0.12 and connected:
            worker_id = rng.choice(connected)
            record = h.core._registry.get(worker_id)
            assert record is not None
            states = {m: rng.choice(STATES) for m in record.repository}
            h.report(worker_id, states, error=rng.choice(["", "", "oom"]), gen=rng.randint(1, 3))
        elif op < 0.42:
            client, priority = rng.choice(CLIENTS)
            h.enqueue(
                self._new_id(),
                model=rng.choice((*MODELS, "unknown")),
                session=rng.choice(self.sessions),
                client=client,
                priority=priority,
                urgency=rng.random(),
                timeout_ms=rng.choice([0.0, 50.0, 500.0]),
            )
        elif op < 0.66:
            granted = [key for key, life in h._lives.items() if life.state == "granted"]
            if granted:
                session, request_id = rng.choice(granted)
                h.complete(
                    request_id,
                    session=session,
                    error=rng.choice(ERRORS),
                    retryable=rng.random() < 0.7,
                    inference_ms=rng.uniform(8.0, 12.0),
                )
        elif op < 0.70:
            queued = [key for key, life in h._lives.items() if life.state == "queued"]
            if queued:
                session, request_id = rng.choice(queued)
                h.cancel(request_id, session=session)
        elif op < 0.72:
            gone = rng.choice(self.sessions)
            h.close_session(gone)
            self.sessions[self.sessions.index(gone)] = new = max(self.sessions) + 1
            self._open(new)
        elif op < 0.82:
            self._use_credit()
        elif op < 0.88:  # to just before the steady client's next request: when holds happen
            self._advance(max(0.0, self.next_tick - 0.002 - h.clock.monotonic()))
        else:
            self._advance(rng.choice([0.001, 0.005, 0.02, 0.1, 0.3]))

    def _use_credit(self) -> None:
        """The gateway's side of credits: run on an idle one (reported before or after the
        run ended), or hand one back (a revoked one first)."""
        h, rng = self.h, self.rng
        if not h.lent:
            return
        revoked = [cid for cid in h.lent if cid in h.revoked]
        if revoked and rng.random() < 0.5:
            h.return_credit(rng.choice(revoked), session=h.lent[revoked[0]][0])
            return
        idle = sorted(cid for cid, (_, c) in h.lent.items() if c.running is None)
        if not idle:
            return
        credit_id = rng.choice(idle)
        session, credit = h.lent[credit_id]
        client, priority = rng.choice(CLIENTS)
        if rng.random() < 0.6:
            h.run(
                self._new_id(),
                credit_id,
                model=credit.model_id,
                session=session,
                client=client,
                priority=priority,
            )
        else:
            h.finished(
                self._new_id(),
                credit_id,
                error=rng.choice(ERRORS),
                retryable=rng.random() < 0.7,
                session=session,
                model=credit.model_id,
                client=client,
                priority=priority,
                inference_ms=rng.uniform(8.0, 12.0),
            )

    def _advance(self, seconds: float) -> None:
        """Move the clock as the hub's timer does, from one `next_deadline` to the next (or,
        now and then, in one leap); the steady priority-0 client sends on each tick it passes."""
        h = self.h
        end = h.clock.monotonic() + seconds
        timer = self.rng.random() < 0.7
        for _ in range(MAX_WAKES):
            now = h.clock.monotonic()
            wake = h.core.next_deadline() if timer else None
            if wake is not None and wake <= min(end, self.next_tick):
                h.advance(max(0.0, wake - now))
            elif self.next_tick <= end:
                h.advance(max(0.0, self.next_tick - now))
                h.enqueue(
                    self._new_id(), model="m1", session=self.sessions[0], client="steady", timeout_ms=30.0
                )
                self.next_tick += TICK_S
            else:
                h.advance(max(0.0, end - now))
                return
        raise AssertionError(f"the timer woke more than {MAX_WAKES} times in {seconds} s")

    def check_counts(self) -> None:
        h = self.h
        h.check()
        stats = h.core.queue_stats()
        lives = Counter(life.state for life in h._lives.values())
        assert sum(s.depth for s in stats) == lives["queued"]
        assert sum(s.inflight for s in stats) == lives["granted"]


@pytest.mark.parametrize("mechanisms", list(MECHANISMS))
@pytest.mark.parametrize("seed", range(12))
def test_random_operations_keep_the_invariant(make_harness: MakeHarness, seed: int, mechanisms: str) -> None:
    rng = random.Random(seed)
    max_inflight = rng.choice([1, 2])
    h = make_harness(
        max_queue_size=rng.choice([3, 50]),
        overflow_policy=rng.choice(list(OverflowPolicy)),
        max_retries=rng.choice([0, 1, 2]),
        max_inflight=lambda model_id: max_inflight,
        latency_budget_ms=lambda client_id: BUDGETS_MS.get(client_id, 50.0),
        **MECHANISMS[mechanisms],
    )
    run = _Run(h, rng, credits=mechanisms == "shipped")
    for _ in range(400):
        run.step()
        run.check_counts()
    # Drain: everything waiting expires, everything granted completes, credits come back.
    h.advance(10.0)
    for _ in range(10):  # a completion may lend a credit again; bounded
        granted = [key for key, life in h._lives.items() if life.state == "granted"]
        for session, request_id in granted:
            h.complete(request_id, session=session)
        for credit_id in list(h.lent):
            h.return_credit(credit_id, session=h.lent[credit_id][0])
        if not granted:
            break
    assert h.core.next_deadline() is None
    h.check(settled=True)
    if mechanisms == "off":
        assert not (h.recorded["credits_lent"] or h.recorded["slot_holds"])
        assert not any(grant.front for grant in h.grants())


def test_the_shipped_mechanisms_are_exercised(make_harness: MakeHarness) -> None:
    """The random sequences above do reach the mechanisms: credits are lent, run on and
    revoked, and the lookahead's estimates become predictable (its windows and the
    reservations' predictions work from them). Holds and front-of-queue grants need a
    steadier workload than these sequences make: test_core_reservations and
    test_core_lookahead drive them."""
    recorded: Counter[str] = Counter()
    predictable = 0
    for seed in range(12):
        rng = random.Random(seed)
        h = make_harness(
            max_queue_size=50,
            max_retries=1,
            max_inflight=lambda model_id: 1,
            latency_budget_ms=lambda client_id: BUDGETS_MS.get(client_id, 50.0),
        )
        run = _Run(h, rng, credits=True)
        for _ in range(400):
            run.step()
            predictable += h.core._lookahead.timing("m1") is not None
        recorded += h.recorded
        h.check()
    assert recorded["credits_lent"] > 0
    assert recorded["credits_revoked"] > 0
    assert recorded["placement_decisions:credit"] > 0  # requests run on credits
    assert predictable > 0
