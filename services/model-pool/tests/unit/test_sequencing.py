"""The sequencer of engines that order nothing themselves: a capacity, the shared order, no pauses."""

from __future__ import annotations

from loadmaster.model_pool.generation_order import OrderPolicy
from loadmaster.model_pool.sequencing import Sequencer


def arrive(sequencer: Sequencer, request_id: str, priority: int, tenant: str = "t") -> list[str]:
    return sequencer.arrive(request_id, priority=priority, tenant=tenant, weight=1.0, now=0.0)


def test_streams_start_up_to_the_capacity_then_wait_in_priority_then_arrival_order() -> None:
    sequencer = Sequencer(capacity=2)
    assert arrive(sequencer, "a", 2) == ["a"]
    assert arrive(sequencer, "b", 2) == ["b"]
    assert arrive(sequencer, "c", 3) == []
    assert arrive(sequencer, "d", 1) == []
    assert arrive(sequencer, "e", 1) == []
    assert (sequencer.running, sequencer.waiting) == (2, 3)
    assert sequencer.position("c", 0.0) == 2 and sequencer.position("a", 0.0) is None
    assert sequencer.finished("a", 0.0) == ["d"]
    assert sequencer.finished("b", 0.0) == ["e"]
    assert sequencer.finished("d", 0.0) == ["c"]


def test_a_priority_0_stream_never_pauses_a_running_one_here() -> None:
    sequencer = Sequencer(capacity=1)
    arrive(sequencer, "low", 3)
    assert arrive(sequencer, "urgent", 0) == []
    assert sequencer.is_waiting("urgent") and not sequencer.is_waiting("low")
    assert sequencer.finished("low", 0.0) == ["urgent"]


def test_within_a_priority_the_tenant_served_least_goes_next() -> None:
    sequencer = Sequencer(capacity=1, policy=OrderPolicy())
    arrive(sequencer, "a0", 1, "a")
    arrive(sequencer, "a1", 1, "a")
    arrive(sequencer, "b0", 1, "b")
    sequencer.charge_prompt("a0", 20)
    sequencer.progressed("a0", 10)
    assert sequencer.finished("a0", 0.0) == ["b0"]


def test_finishing_an_unknown_or_waiting_stream_frees_nothing_twice() -> None:
    sequencer = Sequencer(capacity=1)
    arrive(sequencer, "a", 1)
    arrive(sequencer, "b", 1)
    assert sequencer.finished("b", 0.0) == []  # cancelled while waiting
    assert sequencer.finished("b", 0.0) == []
    assert sequencer.finished("zzz", 0.0) == []
    assert (sequencer.running, sequencer.waiting) == (1, 0)


def test_service_a_tenant_got_on_other_workers_counts_here() -> None:
    sequencer = Sequencer(capacity=1)
    arrive(sequencer, "busy", 1, "c")
    arrive(sequencer, "a0", 1, "a")
    arrive(sequencer, "b0", 1, "b")
    sequencer.set_remote_service({"a": 1000.0})  # a was served plenty elsewhere
    assert sequencer.finished("busy", 0.0) == ["b0"]
    sequencer.charge_prompt("b0", 4)
    assert sequencer.tenant_service() == {"b": 4.0}
