"""A gateway's local queue serves waiting requests in the order the scheduler's central queue
would (docs/data-path.md): the same random workload, pushed into both with the same clock,
comes out in the same order, for every strategy a gateway may keep.

The scheduler side is the real `SchedulerCore` with one worker slot held by a blocker (every
request waits), granting one at a time as each grant completes; the gateway side is the real
`LocalQueues` configured from the `LocalQueue` spec the scheduler would send."""

from __future__ import annotations

import random
from collections.abc import Mapping

import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.common.ordering import make_ordering
from loadmaster.gateway.calls import InferenceCall
from loadmaster.gateway.local_queue import LocalQueues
from loadmaster.scheduler.config import CoreConfig
from loadmaster.scheduler.core import SchedulerCore
from loadmaster.scheduler.domain import (
    Completion,
    Credit,
    Grant,
    Reject,
    RequestInfo,
    SlotState,
    SlotStatus,
    Submission,
    WorkerCommand,
    WorkerHello,
)
from loadmaster.v1 import scheduler_pb2

BUDGETS = {"robot-fast": 10.0, "robot-slow": 80.0}


class _Sink:
    """The core's outbound and telemetry: keeps the grants in order."""

    def __init__(self) -> None:
        self.granted: list[str] = []

    def grant(self, session_id: int, grant: Grant) -> None:
        self.granted.append(grant.request_id)

    def reject(self, session_id: int, reject: Reject) -> None:
        raise AssertionError(f"unexpected reject {reject}")

    def command(self, worker_id: str, command: WorkerCommand) -> None:
        pass

    def lend_credit(self, session_id: int, credit: Credit) -> None:
        pass

    def revoke_credit(self, session_id: int, credit_id: str) -> None:
        pass

    def record(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        pass


def _workload(seed: int) -> list[tuple[float, str, int, float, int | None]]:
    """(gap s, client, priority, urgency, steps) per request: bursts and steady senders."""
    rng = random.Random(seed)
    clients = ["robot-fast", "robot-slow", "dash", "batch-a", "batch-b"]
    out = []
    for _ in range(200):
        gap = rng.choice([0.0, 0.0, 0.001, 0.004, 0.02])
        steps = rng.choice([None, None, 0, 3, 20])
        out.append((gap, rng.choice(clients), rng.choice([0, 1, 2, 3]), rng.choice([0.0, 0.3, 1.0]), steps))
    return out


@pytest.mark.parametrize("strategy", ["model_deadline", "priority_tiered", "priority", "round_robin"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_local_and_central_queues_serve_the_same_order(strategy: str, seed: int) -> None:
    config = CoreConfig(
        max_inflight=lambda model_id: 1,
        max_queue_size=1000,
        request_ttl_ms=60_000.0,
        latency_budget_ms=lambda client_id: BUDGETS.get(client_id, 50.0),
        default_latency_budget_ms=50.0,
        client_latency_budgets_ms=BUDGETS,
        dispatch_credits=0,
        lookahead=0,
        reservation=False,
    )
    scheduler_clock, gateway_clock = FakeClock(), FakeClock()
    sink = _Sink()
    core = SchedulerCore(config, clock=scheduler_clock, outbound=sink, telemetry=sink)  # type: ignore[arg-type]
    core.set_ordering(make_ordering(strategy))
    core.add_worker(WorkerHello("w1", "tcp://w1:5556", repository=("m",)))
    core.update_worker("w1", [SlotStatus("m", SlotState.READY, generation=1)])
    core.submit(1, Submission(enqueues=[RequestInfo("blocker", "m", client_id="blocker")]))
    assert sink.granted == ["blocker"]

    spec = scheduler_pb2.LocalQueue(
        strategy=strategy,
        priority_step_ms=100.0,
        urgency_weight=0.5,
        steps_horizon=8,
        service_ms=10.0,
        latency_budget_ms=50.0,
        client_latency_budget_ms=BUDGETS,
        cadence_alpha=0.3,
        max_queue_size=1000,
    )
    local: LocalQueues[str] = LocalQueues(gateway_clock)
    local.configure("m", spec)

    for index, (gap, client, priority, urgency, steps) in enumerate(_workload(seed)):
        scheduler_clock.advance(gap)
        gateway_clock.advance(gap)
        request_id = f"r{index}"
        info = RequestInfo(request_id, "m", client, priority, urgency, steps_remaining=steps)
        core.submit(1, Submission(enqueues=[info]))
        call = InferenceCall(
            request_id=request_id,
            client_id=client,
            model_id="m",
            inputs=[],
            payload=b"",
            priority=priority,
            urgency=urgency,
            steps_remaining=steps,
        )
        assert local.push(request_id, call, 60_000.0) is None

    central: list[str] = []
    running = "blocker"
    while True:  # bounded: one grant per completion, 200 requests
        core.submit(1, Submission(completes=[Completion(running, worker_id="w1")]))
        if len(sink.granted) == len(central) + 1:
            break
        running = sink.granted[-1]
        central.append(running)
    assert len(central) == 200
    assert local.take_all("m") == central
