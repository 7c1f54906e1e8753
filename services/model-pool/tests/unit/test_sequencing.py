"""The sequencer of engines that order nothing themselves: a capacity, the shared order, no pauses."""

from __future__ import annotations

from loadmaster.model_pool.generation_order import OrderPolicy, Transition
from loadmaster.model_pool.sequencing import Sequencer

START, PAUSE, RESUME = Transition.START, Transition.PAUSE, Transition.RESUME


def started(transitions: list[tuple[Transition, str]]) -> list[str]:
    return [request_id for kind, request_id in transitions if kind is START]


def arrive(sequencer: Sequencer, request_id: str, priority: int, tenant: str = "t") -> list[str]:
    return started(sequencer.arrive(request_id, priority=priority, tenant=tenant, weight=1.0, now=0.0))


def finished(sequencer: Sequencer, request_id: str) -> list[str]:
    return started(sequencer.finished(request_id, 0.0))


def test_streams_start_up_to_the_capacity_then_wait_in_priority_then_arrival_order() -> None:
    sequencer = Sequencer(capacity=2)
    assert arrive(sequencer, "a", 2) == ["a"]
    assert arrive(sequencer, "b", 2) == ["b"]
    assert arrive(sequencer, "c", 3) == []
    assert arrive(sequencer, "d", 1) == []
    assert arrive(sequencer, "e", 1) == []
    assert (sequencer.running, sequencer.waiting) == (2, 3)
    assert sequencer.position("c", 0.0) == 2 and sequencer.position("a", 0.0) is None
    assert finished(sequencer, "a") == ["d"]
    assert finished(sequencer, "b") == ["e"]
    assert finished(sequencer, "d") == ["c"]


def test_for_an_engine_that_cannot_pause_a_priority_0_stream_waits_for_a_place() -> None:
    sequencer = Sequencer(capacity=1)
    arrive(sequencer, "low", 3)
    assert arrive(sequencer, "urgent", 0) == []
    assert sequencer.is_waiting("urgent") and not sequencer.is_waiting("low")
    assert finished(sequencer, "low") == ["urgent"]


def test_for_an_engine_that_can_pause_a_priority_0_stream_takes_a_place_at_once() -> None:
    sequencer = Sequencer(capacity=1, can_pause=True)
    arrive(sequencer, "low", 3)
    assert sequencer.arrive("urgent", priority=0, tenant="t", weight=1.0, now=0.0) == [
        (PAUSE, "low"),
        (START, "urgent"),
    ]
    assert sequencer.finished("urgent", 0.0) == [(RESUME, "low")]


def test_with_timeslices_a_running_stream_yields_once_its_slice_is_used() -> None:
    sequencer = Sequencer(capacity=1, policy=OrderPolicy(timeslice_tokens=4), can_pause=True)
    arrive(sequencer, "low", 3)
    arrive(sequencer, "better", 1)
    assert sequencer.progressed("low", 3, 0.0) == []
    assert sequencer.progressed("low", 1, 0.0) == [(PAUSE, "low"), (START, "better")]


def test_within_a_priority_the_tenant_served_least_goes_next() -> None:
    sequencer = Sequencer(capacity=1, policy=OrderPolicy())
    arrive(sequencer, "a0", 1, "a")
    arrive(sequencer, "a1", 1, "a")
    arrive(sequencer, "b0", 1, "b")
    sequencer.charge_prompt("a0", 20)
    sequencer.progressed("a0", 10, 0.0)
    assert finished(sequencer, "a0") == ["b0"]


def test_finishing_an_unknown_or_waiting_stream_frees_nothing_twice() -> None:
    sequencer = Sequencer(capacity=1)
    arrive(sequencer, "a", 1)
    arrive(sequencer, "b", 1)
    assert finished(sequencer, "b") == []  # cancelled while waiting
    assert finished(sequencer, "b") == []
    assert finished(sequencer, "zzz") == []
    assert (sequencer.running, sequencer.waiting) == (1, 0)


def test_service_a_tenant_got_on_other_workers_counts_here() -> None:
    sequencer = Sequencer(capacity=1)
    arrive(sequencer, "busy", 1, "c")
    arrive(sequencer, "a0", 1, "a")
    arrive(sequencer, "b0", 1, "b")
    sequencer.set_remote_service({"a": 1000.0})  # a was served plenty elsewhere
    assert finished(sequencer, "busy") == ["b0"]
    sequencer.charge_prompt("b0", 4)
    assert sequencer.tenant_service() == {"b": 4.0}
