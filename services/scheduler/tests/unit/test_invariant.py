"""Random operation sequences: every admitted request ends exactly once, and the core's
counts always match what the gateway side has seen."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import pytest

from loadmaster.scheduler.domain import OverflowPolicy, SlotState
from loadmaster.v1 import errors_pb2

if TYPE_CHECKING:
    from conftest import Harness, MakeHarness

MODELS = ("m1", "m2")
WORKERS = ("w1", "w2", "w3")
STATES = (SlotState.READY, SlotState.READY, SlotState.LOADING, SlotState.IDLE)


def _lives(h: Harness, state: str) -> list[tuple[int, str]]:
    return [key for key, life in h._lives.items() if life.state == state]


def _step(h: Harness, rng: random.Random, sessions: list[int], counter: list[int]) -> None:
    op = rng.random()
    connected = [v.hello.worker_id for v in h.core.workers()]
    if op < 0.08:
        h.worker(rng.choice(WORKERS), rng.sample(MODELS, rng.randint(1, 2)))
    elif op < 0.12 and connected:
        h.lose_worker(rng.choice(connected))
    elif op < 0.25 and connected:
        worker_id = rng.choice(connected)
        record = h.core._registry.get(worker_id)
        assert record is not None
        states = {m: rng.choice(STATES) for m in record.repository}
        h.report(worker_id, states, error=rng.choice(["", "", "oom"]), gen=rng.randint(1, 3))
    elif op < 0.55:
        counter[0] += 1
        h.enqueue(
            f"r{counter[0]}",
            model=rng.choice((*MODELS, "unknown")),
            session=rng.choice(sessions),
            priority=rng.randint(0, 2),
            urgency=rng.random(),
            timeout_ms=rng.choice([0.0, 50.0, 500.0]),
        )
    elif op < 0.80:
        granted = _lives(h, "granted")
        if granted:
            session, request_id = rng.choice(granted)
            error = rng.choice([0, 0, errors_pb2.ERROR_CODE_UNAVAILABLE, errors_pb2.ERROR_CODE_INTERNAL])
            h.complete(request_id, session=session, error=error, retryable=rng.random() < 0.7)
    elif op < 0.85:
        queued = _lives(h, "queued")
        if queued:
            session, request_id = rng.choice(queued)
            h.cancel(request_id, session=session)
    elif op < 0.87:
        gone = rng.choice(sessions)
        h.close_session(gone)
        sessions[sessions.index(gone)] = max(sessions) + 1
    else:
        h.advance(rng.choice([0.001, 0.02, 0.1, 0.3]))


@pytest.mark.parametrize("seed", range(12))
def test_random_operations_keep_the_invariant(make_harness: MakeHarness, seed: int) -> None:
    rng = random.Random(seed)
    h = make_harness(
        max_queue_size=rng.choice([3, 50]),
        overflow_policy=rng.choice(list(OverflowPolicy)),
        max_retries=rng.choice([0, 1, 2]),
        max_inflight=lambda model_id: 2,
    )
    sessions = [1, 2]
    counter = [0]
    for _ in range(400):
        _step(h, rng, sessions, counter)
        h.check()
        stats = h.core.queue_stats()
        assert sum(s.depth for s in stats) == len(_lives(h, "queued"))
        assert sum(s.inflight for s in stats) == len(_lives(h, "granted"))
    # Drain: everything waiting expires, everything granted completes.
    h.advance(10.0)
    for session, request_id in _lives(h, "granted"):
        h.complete(request_id, session=session)
    assert h.core.next_deadline() is None
    h.check(settled=True)
