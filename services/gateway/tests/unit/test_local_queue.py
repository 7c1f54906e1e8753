"""LocalQueues: the gateway's waiting room ranks with the scheduler's strategy code and inputs."""

from __future__ import annotations

import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.common.ordering import InferenceRequest, register_policy
from loadmaster.gateway.calls import InferenceCall
from loadmaster.gateway.local_queue import LocalQueues
from loadmaster.v1 import scheduler_pb2


def _spec(strategy: str = "model_deadline", **fields: object) -> scheduler_pb2.LocalQueue:
    values: dict[str, object] = {
        "strategy": strategy,
        "priority_step_ms": 100.0,
        "urgency_weight": 0.5,
        "steps_horizon": 8,
        "service_ms": 10.0,
        "latency_budget_ms": 50.0,
        "cadence_alpha": 0.3,
        "max_queue_size": 100,
    }
    values.update(fields)
    return scheduler_pb2.LocalQueue(**values)  # type: ignore[arg-type]


def _call(request_id: str, client: str, **fields: object) -> InferenceCall:
    return InferenceCall(
        request_id=request_id, client_id=client, model_id="m", inputs=[], payload=b"", **fields
    )  # type: ignore[arg-type]


def _queues(spec: scheduler_pb2.LocalQueue) -> tuple[LocalQueues[str], FakeClock]:
    clock = FakeClock()
    queues: LocalQueues[str] = LocalQueues(clock)
    queues.configure("m", spec)
    return queues, clock


def _push(queues: LocalQueues[str], request_id: str, client: str, **fields: object) -> None:
    assert queues.push(request_id, _call(request_id, client, **fields), 1000.0) is None


def test_a_burst_keeps_its_order_and_a_later_client_waits_its_slack() -> None:
    queues, clock = _queues(_spec())
    for request_id in ("a1", "a2", "a3"):
        _push(queues, request_id, "a")
    clock.advance(0.001)
    _push(queues, "b1", "b")
    # a2 and a3 (cadence ~0, so one service time, plus their backlog) would rank before a1, but a
    # client's virtual deadline never precedes its previous one; b1 (no cadence yet) gets the
    # whole 50 ms budget from 1 ms later
    assert queues.take_all("m") == ["a1", "a2", "a3", "b1"]


def test_a_client_with_a_shorter_budget_goes_first() -> None:
    queues, clock = _queues(_spec(client_latency_budget_ms={"robot": 5.0}))
    _push(queues, "slow", "dashboard")
    clock.advance(0.002)
    _push(queues, "fast", "robot")
    assert queues.take_all("m") == ["fast", "slow"]


def test_priority_and_urgency_shorten_the_wait() -> None:
    queues, _clock = _queues(_spec())
    _push(queues, "p2", "a", priority=2)
    _push(queues, "p1", "b", priority=1)
    _push(queues, "p1-urgent", "c", priority=1, urgency=1.0)
    _push(queues, "p0", "d", priority=0)
    assert queues.take_all("m") == ["p0", "p1-urgent", "p1", "p2"]


def test_round_robin_serves_one_call_per_client_per_round() -> None:
    queues, _clock = _queues(_spec("round_robin"))
    for request_id, client in (("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b"), ("b2", "b")):
        _push(queues, request_id, client)
    assert queues.take_all("m") == ["a1", "b1", "a2", "b2", "a3"]


def test_removed_and_expired_calls_leave_the_queue() -> None:
    queues, clock = _queues(_spec())
    _push(queues, "r1", "a")
    assert queues.push("r2", _call("r2", "a"), 20.0) is None
    _push(queues, "r3", "a")
    assert queues.remove("r3") == "r3" and "r3" not in queues
    assert queues.expired() == []
    clock.advance(0.025)
    [(item, message)] = queues.expired()
    assert item == "r2" and message == "expired after waiting 25 ms for model 'm'"
    assert len(queues) == 1 and queues.take_all("m") == ["r1"]


def test_stopping_keeps_the_waiting_calls_but_takes_no_new_ones() -> None:
    queues, _clock = _queues(_spec())
    _push(queues, "r1", "a")
    queues.configure("m", None)
    assert not queues.accepts("m") and queues.waiting("m") == 1
    assert queues.pop("m") == "r1"
    assert not queues.accepts("m") and queues.waiting("m") == 0


def test_tiered_deadline_ranks_by_the_tiers_its_spec_carries() -> None:
    """tiers [0, 2]: priorities 1 and 2 share the second tier, so an earlier priority-2 call goes
    before a later priority-1 one; with the default tiers [0, 1, 2] the priority-1 call would."""
    queues, clock = _queues(_spec("tiered_deadline", tiers=[0, 2], priority_step_ms=0.0))
    _push(queues, "p2", "a", priority=2)
    clock.advance(0.001)
    _push(queues, "p1", "b", priority=1)
    clock.advance(0.001)
    _push(queues, "p0", "c", priority=0)
    assert queues.take_all("m") == ["p0", "p2", "p1"]
    queues, clock = _queues(_spec("tiered_deadline", priority_step_ms=0.0))
    _push(queues, "p2", "a", priority=2)
    clock.advance(0.001)
    _push(queues, "p1", "b", priority=1)
    assert queues.take_all("m") == ["p1", "p2"]


def test_a_registered_policy_in_the_spec_ranks_the_calls() -> None:
    """The policy's slack (here: the client's name decides) replaces the budget's."""

    @register_policy("gateway-local-queue-test")
    def by_client(request: InferenceRequest) -> float:
        return 1.0 if request.client_id == "arm" else 100.0

    queues, clock = _queues(_spec(policy="gateway-local-queue-test"))
    _push(queues, "slow", "dashboard")
    clock.advance(0.002)
    _push(queues, "fast", "arm")
    assert queues.take_all("m") == ["fast", "slow"]


def test_a_policy_this_gateway_does_not_know_ranks_without_it(caplog: pytest.LogCaptureFixture) -> None:
    queues, clock = _queues(_spec(policy="never-registered"))
    _push(queues, "first", "dashboard")
    clock.advance(0.002)
    _push(queues, "second", "arm")
    assert queues.take_all("m") == ["first", "second"]
    assert "never-registered" in caplog.text
