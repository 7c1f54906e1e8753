"""The gateway orders a model's calls as the scheduler's central queue would (docs/data-path.md):
the same random workload, on the same clock, comes out in the same order, for every strategy a
gateway may keep.

- `LocalQueues` alone: the real `SchedulerCore` with one worker slot held by a blocker (every
  request waits) against the real `LocalQueues` configured from the `LocalQueue` spec the
  scheduler would send.
- The whole dispatcher, mixed traffic: the real `Dispatcher` holding the model's whole share
  (several credits, a local queue) against the core with as many slots; calls that find an idle
  credit and run at once, calls that wait, completions of random running calls between
  arrivals. The order the dispatcher sends calls to the worker must be the order the core
  grants them. With the share held nothing reaches the scheduler but reports, so this is the
  order issue 35's request plane must keep when the gateway admits every call itself. It found
  two differences, since mended: calls run at once were invisible to the local order, and the
  local backlog left out a client's running calls."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.common.ordering import InferenceRequest, make_ordering, register_policy
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.gateway.calls import CallResult, InferenceCall
from loadmaster.gateway.dispatcher import Dispatcher
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
from loadmaster.v1 import model_pool_pb2, scheduler_pb2

BUDGETS = {"robot-fast": 10.0, "robot-slow": 80.0}
SLOTS = 3
REQUESTS = 300


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


class _SessionDouble:
    """The gateway's scheduler session: with the whole share held it only hears reports."""

    connected = True
    session = 1

    def __init__(self) -> None:
        self.enqueued: list[str] = []

    def enqueue(self, request: scheduler_pb2.RequestInfo) -> None:
        self.enqueued.append(request.request_id)

    def report_run(self, request_id: str, model_id: str, info: Any, *, countable: bool = False) -> None:
        pass

    def complete(self, request_id: str, **_: Any) -> None:
        pass

    def cancel(self, request_id: str) -> None:
        pass

    def return_credit(self, credit_id: str) -> None:
        pass

    def report_local_depth(self, model_id: str, waiting: int, outstanding_s: float = 0.0) -> None:
        pass


class _WorkerDouble:
    def __init__(self) -> None:
        self.sent: list[str] = []

    def send(self, endpoint: str, envelope: bytes, payload: Any) -> None:
        self.sent.append(model_pool_pb2.InferRequest.FromString(envelope).request_id)


def _workload(seed: int, count: int = 200) -> list[tuple[float, str, int, float, int | None, int]]:
    """(gap s, client, priority, urgency, steps, completions before it) per request: bursts and
    steady senders."""
    rng = random.Random(seed)
    clients = ["robot-fast", "robot-slow", "dash", "batch-a", "batch-b"]
    out = []
    for _ in range(count):
        gap = rng.choice([0.0, 0.0, 0.001, 0.004, 0.02])
        steps = rng.choice([None, None, 0, 3, 20])
        out.append(
            (
                gap,
                rng.choice(clients),
                rng.choice([0, 1, 2, 3]),
                rng.choice([0.0, 0.3, 1.0]),
                steps,
                rng.choice([0, 0, 0, 1, 1, 2]),
            )
        )
    return out


@register_policy("gateway-order-test")
def _policy(request: InferenceRequest) -> float:
    """A registered policy (the gateway imports it as the scheduler does): slack from priority,
    urgency and the client's unanswered calls."""
    return 5.0 + 40.0 * request.priority - 20.0 * request.urgency + 3.0 * request.queued_by_client


# Every strategy a gateway keeps; "name/policy" is the deadline family with a registered policy.
STRATEGIES = [
    "model_deadline",
    "model_deadline/gateway-order-test",
    "deadline_aware",
    "tiered_deadline",
    "priority_tiered",
    "priority",
    "round_robin",
]


def _spec(strategy: str) -> scheduler_pb2.LocalQueue:
    strategy, _, policy = strategy.partition("/")
    return scheduler_pb2.LocalQueue(
        strategy=strategy,
        policy=policy,
        priority_step_ms=100.0,
        urgency_weight=0.5,
        steps_horizon=8,
        service_ms=10.0,
        latency_budget_ms=50.0,
        client_latency_budget_ms=BUDGETS,
        cadence_alpha=0.3,
        max_queue_size=1000,
    )


def _core(strategy: str, slots: int) -> tuple[SchedulerCore, _Sink, FakeClock]:
    """The real scheduler core, `slots` slots of model `m` on one READY worker, its own clock."""
    config = CoreConfig(
        max_inflight=lambda model_id: slots,
        max_queue_size=1000,
        request_ttl_ms=60_000.0,
        latency_budget_ms=lambda client_id: BUDGETS.get(client_id, 50.0),
        default_latency_budget_ms=50.0,
        client_latency_budgets_ms=BUDGETS,
        dispatch_credits=0,
        lookahead=0,
    )
    clock, sink = FakeClock(), _Sink()
    core = SchedulerCore(config, clock=clock, outbound=sink, telemetry=sink)  # type: ignore[arg-type]
    name, _, policy = strategy.partition("/")
    core.set_ordering(make_ordering(name, policy=policy or None))
    core.add_worker(WorkerHello("w1", "tcp://w1:5556", repository=("m",)))
    core.update_worker("w1", [SlotStatus("m", SlotState.READY, generation=1)])
    return core, sink, clock


def _arrive(
    core: SchedulerCore, request_id: str, client: str, priority: int, urgency: float, steps: int | None
) -> InferenceCall:
    """The request enqueued at the core, and the same request as the gateway's call."""
    core.submit(
        1,
        Submission(enqueues=[RequestInfo(request_id, "m", client, priority, urgency, steps_remaining=steps)]),
    )
    return InferenceCall(
        request_id=request_id,
        client_id=client,
        model_id="m",
        inputs=[],
        payload=b"",
        priority=priority,
        urgency=urgency,
        steps_remaining=steps,
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_local_and_central_queues_serve_the_same_order(strategy: str, seed: int) -> None:
    core, sink, scheduler_clock = _core(strategy, 1)
    gateway_clock = FakeClock()
    core.submit(1, Submission(enqueues=[RequestInfo("blocker", "m", client_id="blocker")]))
    assert sink.granted == ["blocker"]

    local: LocalQueues[str] = LocalQueues(gateway_clock)
    local.configure("m", _spec(strategy))

    for index, (gap, client, priority, urgency, steps, _) in enumerate(_workload(seed)):
        scheduler_clock.advance(gap)
        gateway_clock.advance(gap)
        request_id = f"r{index}"
        assert (
            local.push(request_id, _arrive(core, request_id, client, priority, urgency, steps), 60_000.0)
            is None
        )

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


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
async def test_the_dispatcher_sends_in_the_order_the_scheduler_grants(strategy: str, seed: int) -> None:
    core, sink, scheduler_clock = _core(strategy, SLOTS)
    gateway_clock = FakeClock()

    session, worker = _SessionDouble(), _WorkerDouble()
    dispatcher = Dispatcher(
        scheduler=lambda _: session,
        workers=lambda _: worker,
        telemetry=TelemetryReporter("gateway", "test", None),
        clock=gateway_clock,
    )
    dispatcher.start()
    results: list[CallResult] = []
    try:
        for index in range(SLOTS):  # the whole share: every slot, each credit carrying the spec
            credit = scheduler_pb2.Credit(
                credit_id=f"c{index}",
                model_id="m",
                worker_id="w1",
                data_endpoint="tcp://w1:5556",
                generation=1,
                request_ttl_ms=60_000.0,
            )
            credit.local_queue.CopyFrom(_spec(strategy))
            dispatcher.on_credit(credit)
        rng = random.Random(seed * 1000)
        for index, (gap, client, priority, urgency, steps, completions) in enumerate(
            _workload(seed, REQUESTS)
        ):
            for _ in range(completions):  # the same running call ends on both sides
                running = [r for r in sink.granted if r not in {x.request_id for x in results}]
                if not running:
                    break
                done = rng.choice(running)
                core.submit(1, Submission(completes=[Completion(done, worker_id="w1")]))
                dispatcher.on_worker_reply(
                    model_pool_pb2.InferResponse(request_id=done, model_id="m", worker_id="w1"), b""
                )
            scheduler_clock.advance(gap)
            gateway_clock.advance(gap)
            request_id = f"r{index}"
            call = _arrive(core, request_id, client, priority, urgency, steps)
            dispatcher.submit(call, results.append)
            assert worker.sent == sink.granted, f"the orders parted after {request_id}"
        while len(results) < REQUESTS:  # bounded: each turn ends one running call
            running = [r for r in sink.granted if r not in {x.request_id for x in results}]
            assert running, "calls wait with nothing running"
            core.submit(1, Submission(completes=[Completion(running[0], worker_id="w1")]))
            dispatcher.on_worker_reply(
                model_pool_pb2.InferResponse(request_id=running[0], model_id="m", worker_id="w1"), b""
            )
        assert worker.sent == sink.granted and len(worker.sent) == REQUESTS
        assert session.enqueued == []  # nothing went to the scheduler's queue
        assert all(r.ok for r in results)
    finally:
        await dispatcher.close()
