"""The order of generations (generation_order.py): priority classes, token fairness between
tenants (virtual token counters), promotion, preemption and timeslices, as plain decisions."""

from __future__ import annotations

import pytest

from loadmaster.model_pool.generation_order import (
    GenerationOrder,
    OrderPolicy,
    TenantCounters,
    Transition,
)

START, RESUME, PAUSE = Transition.START, Transition.RESUME, Transition.PAUSE


def add(order: GenerationOrder, request_id: str, priority: int = 1, tenant: str = "t", **kw: float) -> None:
    order.add(
        request_id,
        priority=priority,
        tenant=tenant,
        weight=kw.get("weight", 1.0),
        prompt_tokens=int(kw.get("prompt", 10)),
        now=kw.get("now", 0.0),
    )


def started(
    order: GenerationOrder, *, capacity: int, now: float = 0.0, can_pause: bool = True
) -> list[tuple[Transition, str]]:
    return order.plan(capacity=capacity, now=now, can_pause=can_pause).transitions


def test_within_capacity_everything_starts_in_priority_then_arrival_order() -> None:
    order = GenerationOrder()
    for name, priority in (("a", 2), ("b", 1), ("c", 2), ("d", 1)):
        add(order, name, priority)
    assert started(order, capacity=3) == [(START, "b"), (START, "d"), (START, "a")]
    assert [e.request_id for e in order.waiting] == ["c"]
    assert order.positions(0.0) == {"c": 0}


def test_a_class_0_arrival_pauses_the_lowest_class_newest_running_one_which_resumes_first() -> None:
    order = GenerationOrder()
    for name in ("old", "new"):
        add(order, name, 2)
    add(order, "mid", 1)
    assert len(started(order, capacity=3)) == 3
    add(order, "urgent", 0)
    assert started(order, capacity=3) == [(PAUSE, "new"), (START, "urgent")]
    assert order.totals.preemptions == 1
    order.remove("urgent")
    assert started(order, capacity=3) == [(RESUME, "new")]
    assert order.totals.resumes == 1


def test_no_pause_without_can_pause_and_never_for_equal_or_non_urgent_classes() -> None:
    order = GenerationOrder()
    add(order, "low", 2)
    started(order, capacity=1)
    add(order, "urgent", 0)
    assert started(order, capacity=1, can_pause=False) == []
    add(order, "better", 1)  # better class, but not urgent and timeslices are off
    order.remove("urgent")
    assert started(order, capacity=1) == []
    order2 = GenerationOrder()
    add(order2, "u1", 0)
    started(order2, capacity=1)
    add(order2, "u2", 0)
    assert started(order2, capacity=1) == []  # class 0 never pauses class 0


def test_a_timeslice_makes_lower_class_work_yield_after_its_tokens_and_resume_later() -> None:
    order = GenerationOrder(OrderPolicy(timeslice_tokens=4))
    add(order, "low", 2)
    started(order, capacity=1)
    add(order, "better", 1)
    order.progressed("low", 3)
    assert started(order, capacity=1) == []  # its slice is not used up yet
    order.progressed("low", 1)
    assert started(order, capacity=1) == [(PAUSE, "low"), (START, "better")]
    assert (order.totals.yields, order.totals.preemptions) == (1, 0)
    order.remove("better")
    assert started(order, capacity=1) == [(RESUME, "low")]


def test_waiting_work_rises_one_class_per_promote_after_s_and_never_by_milliseconds() -> None:
    order = GenerationOrder(OrderPolicy(promote_after_s=10.0))
    add(order, "running", 1)
    started(order, capacity=1)
    add(order, "old-low", 2, now=0.0)
    add(order, "new-mid", 1, now=0.5)
    assert [e.request_id for e in order.ordered_waiting(now=9.9)] == ["new-mid", "old-low"]
    # after 10 s old-low is class 1, and older than new-mid
    assert [e.request_id for e in order.ordered_waiting(now=10.0)] == ["old-low", "new-mid"]
    # after 20 s it is class 0: it may take the place of the class-1 runner
    assert started(order, capacity=1, now=20.0) == [(PAUSE, "running"), (START, "old-low")]


def test_within_a_class_the_backlogged_tenant_with_the_lowest_counter_goes_next() -> None:
    order = GenerationOrder()
    for index in range(4):
        add(order, f"a{index}", tenant="a", prompt=10)
    add(order, "b0", tenant="b", prompt=10)
    assert started(order, capacity=1) == [(START, "a0")]  # equal counters: arrival
    order.progressed("a0", 5)  # a: 10 + 2 x 5 = 20, b: 0 (lifted to a's 0 when it came)
    order.remove("a0")
    assert started(order, capacity=1) == [(START, "b0")]
    order.remove("b0")  # b: 10
    assert started(order, capacity=1) == [(START, "a1")]


def test_fairness_off_is_arrival_order() -> None:
    order = GenerationOrder(OrderPolicy(fairness=False))
    add(order, "a0", tenant="a")
    started(order, capacity=1)
    order.progressed("a0", 100)
    add(order, "a1", tenant="a")
    add(order, "b0", tenant="b")
    order.remove("a0")
    assert started(order, capacity=1) == [(START, "a1")]


def test_weights_divide_what_a_tenant_is_charged() -> None:
    counters = TenantCounters()
    counters.joined("heavy")
    counters.joined("light")
    counters.charge_output("heavy", 10, weight=2.0)
    counters.charge_output("light", 10, weight=1.0)
    assert counters.counter("heavy") == pytest.approx(10.0)
    assert counters.counter("light") == pytest.approx(20.0)
    assert counters.gap() == pytest.approx(10.0)


def test_a_tenant_returning_from_idle_is_lifted_to_the_lowest_backlogged_counter() -> None:
    counters = TenantCounters()
    counters.joined("busy")
    counters.joined("other")
    counters.charge_output("busy", 100, weight=1.0)  # 200
    counters.charge_output("other", 50, weight=1.0)  # 100
    counters.joined("idle")  # never served: lifted to the lowest backlogged, 100
    assert counters.counter("idle") == pytest.approx(100.0)
    counters.left("idle")
    counters.joined("idle")  # still backlogged elsewhere: no change, no credit banked
    assert counters.counter("idle") == pytest.approx(100.0)
    # when nobody is backlogged, a newcomer starts at the highest counter seen
    for tenant in ("busy", "other", "idle"):
        counters.left(tenant)
    counters.joined("late")
    assert counters.counter("late") == pytest.approx(200.0)


def test_service_on_other_workers_counts_toward_a_tenants_counter() -> None:
    order = GenerationOrder()
    add(order, "a0", tenant="a")
    add(order, "b0", tenant="b")
    order.counters.set_remote({"a": 500.0})
    assert [e.request_id for e in order.ordered_waiting(0.0)] == ["b0", "a0"]


def test_a_paused_generation_is_not_charged_its_prompt_twice() -> None:
    order = GenerationOrder()
    add(order, "low", 2, tenant="a", prompt=7)
    started(order, capacity=1)
    add(order, "urgent", 0, tenant="b")
    started(order, capacity=1)
    order.remove("urgent")
    started(order, capacity=1)
    assert order.counters.prompt_tokens["a"] == 7
