"""Timed lookahead in the core: a busy slot takes its next grant just before it is predicted
to free (not before, and only `lookahead` ahead), and a head that could only start after its
deadline is answered `expired` instead of taking the slot. Fake clock; times in ms from t0."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from loadmaster.common.ordering import BatchRule, make_ordering
from loadmaster.scheduler.config import ModelPolicy
from loadmaster.scheduler.domain import OverflowPolicy, SlotState
from loadmaster.scheduler.lookahead import Lookahead
from loadmaster.v1 import errors_pb2

if TYPE_CHECKING:
    from conftest import Harness, MakeHarness

MS = 0.001


@pytest.fixture
def h(make_harness: MakeHarness) -> Harness:
    """One worker, one slot for "m" (max_inflight 1), lookahead 1, margin 0.5 ms; the first
    requests teach the estimates: 12 ms from grant to Complete, 10 of them inference, so the
    send and reply paths take 1 ms each."""
    h = make_harness(model_policy=lambda model_id: POLICY, lookahead_margin_ms=0.5)
    h.worker("w1", ["m"], ready=["m"])
    teach(h, [10.0] * STEADY)
    return h


POLICY = ModelPolicy(100, 1000.0, OverflowPolicy.REJECT_NEWEST, lookahead=1)
WARM_UP = 5  # samples until a steady model counts as predictable (its deviation starts at mean / 2)
STEADY = 40  # samples until that deviation is gone (it decays by 3/4 per steady sample)


def teach(h: Harness, inference_ms: list[float]) -> None:
    for n, ms in enumerate(inference_ms):
        h.enqueue(f"warm-{n}")
        h.advance((ms + 2) * MS)
        h.complete(f"warm-{n}", inference_ms=ms)


def test_the_next_request_is_granted_just_before_the_slot_frees(h: Harness) -> None:
    t0 = h.clock.monotonic()
    h.enqueue("b", "c", "d")  # b starts at once: predicted to end at t0 + 1 + 10 ms
    assert h.granted_ids()[STEADY:] == ["b"]
    opens = h.core.next_deadline()
    assert opens == pytest.approx(t0 + (11 - 1 - 0.5) * MS)  # its end - send time - margin
    h.advance(9 * MS)
    assert h.granted_ids()[STEADY:] == ["b"]  # too early: c would wait at the worker
    h.advance(0.6 * MS)
    assert h.granted_ids()[STEADY:] == ["b", "c"]  # staged while b still runs
    h.advance(2.4 * MS)
    assert "d" not in h.granted_ids()  # one ahead, no more
    h.complete("b", inference_ms=10.0)  # at t0 + 12: c has been running since ~11
    assert "d" not in h.granted_ids()  # the window closed with b's Complete
    assert h.core.next_deadline() == pytest.approx(t0 + (12 - 1 + 10 - 1 - 0.5) * MS)
    h.advance((19.6 - 12) * MS)
    assert h.granted_ids()[STEADY:] == ["b", "c", "d"]
    h.complete("c", inference_ms=10.0)
    h.complete("d", inference_ms=10.0)
    h.check(settled=True)


def test_without_lookahead_a_busy_slot_waits_for_its_complete(make_harness: MakeHarness) -> None:
    h = make_harness(lookahead=0)
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("a")
    h.advance(12 * MS)
    h.complete("a", inference_ms=10.0)
    h.enqueue("b", "c")
    h.advance(50 * MS)
    assert h.granted_ids() == ["a", "b"]
    assert h.core.next_deadline() == pytest.approx(h.clock.monotonic() - 50 * MS + 1.0)  # c's TTL


def test_a_head_that_would_start_after_its_deadline_is_expired_not_staged(h: Harness) -> None:
    t0 = h.clock.monotonic()
    h.enqueue("b")  # running, predicted to end at t0 + 11 ms
    h.enqueue("low", priority=2)
    h.enqueue("late", priority=0, timeout_ms=10.5)  # the head, but its deadline is before b ends
    h.advance(9.6 * MS)
    assert "late" not in h.granted_ids() and "low" in h.granted_ids()
    [reject] = h.rejects()
    assert (reject.request_id, reject.error_code) == ("late", errors_pb2.ERROR_CODE_EXPIRED)
    assert h.clock.monotonic() < t0 + 10.5 * MS  # answered before its deadline, not after
    h.complete("b", inference_ms=10.0)
    h.complete("low", inference_ms=10.0)
    h.check(settled=True)


def test_a_worker_report_keeps_an_open_window(h: Harness) -> None:
    h.enqueue("b", "c")
    h.advance(9.6 * MS)
    assert h.granted_ids()[STEADY:] == ["b", "c"]
    h.report("w1", {"m": SlotState.READY})  # rebuilds the worker's grant candidates
    candidate = h.core._registry.get("w1").candidates["m"]  # type: ignore[union-attr]
    assert (candidate.inflight, candidate.ahead) == (2, 1)
    h.enqueue("d")
    assert "d" not in h.granted_ids()  # still one ahead at most
    h.complete("b", inference_ms=10.0)
    assert candidate.ahead == 0


def test_a_window_closes_once_its_prediction_has_passed(h: Harness) -> None:
    t0 = h.clock.monotonic()
    h.enqueue("b")  # predicted to end at t0 + 11 ms; it will run far longer
    h.enqueue("x")
    h.advance(9.6 * MS)  # window open: x staged
    assert h.granted_ids()[STEADY:] == ["b", "x"]
    h.enqueue("y")
    h.clock.advance(3 * MS)  # t0 + 12.6 ms: past end + send time + margin
    h.enqueue("z")  # the next dispatch closes the window: no request lands behind an overrun
    candidate = h.core._registry.get("w1").candidates["m"]  # type: ignore[union-attr]
    assert candidate.ahead == 0
    assert h.core.next_deadline() == pytest.approx(t0 + 9.6 * MS + 1.0)  # y TTL: no wake for the window
    h.complete("b", inference_ms=10.0)
    assert h.granted_ids()[STEADY:] == ["b", "x"]  # x took b's slot; y and z wait their turn


def test_a_model_with_unsteady_inference_times_never_stages(make_harness: MakeHarness) -> None:
    h = make_harness(model_policy=lambda model_id: POLICY)
    h.worker("w1", ["m"], ready=["m"])
    teach(h, [1.0, 1500.0, 1.0, 1500.0, 1.0, 1.0, 1.0])
    h.enqueue("long", "next")
    assert h.core.next_deadline() == pytest.approx(h.clock.monotonic() + 1.0)  # only the TTL
    h.advance(0.5)
    assert h.granted_ids()[-1] == "long"


def taught() -> tuple[Lookahead, float]:
    """A lookahead that saw WARM_UP requests of 10 ms inference, 12 ms from grant to Complete,
    on worker "w"; the last one was granted at the returned time and runs."""
    look = Lookahead(margin_s=0.0)
    key = (1, "a")
    look.granted("w", "m", key, 0.0, max_inflight=1)
    assert look.next_open(["m"], 0.0) is None  # nothing measured yet: no prediction, no window
    for n in range(WARM_UP):
        assert look.completed(key, n * 0.012 + 0.012, inference_ms=10.0) is None
        key = (1, f"a{n}")
        look.granted("w", "m", key, n * 0.012 + 0.012, max_inflight=1)
    return look, WARM_UP * 0.012


# what is left of the first sample's deviation (mean / 2, decaying by 3/4 per steady sample)
JITTER = 0.005 * 0.75 ** (WARM_UP - 1)


def test_estimates_and_forgetting() -> None:
    look, start = taught()
    # its end - send time - twice the jitter
    assert look.next_open(["m"], start) == pytest.approx(start + 0.001 + 0.010 - 0.001 - 2 * JITTER)
    assert look.next_open(["other"], start) is None  # only models with waiters wake the core
    # a request staged now would start at start + 11 ms, give or take the jitter
    assert look.too_late("w", "m", start + 0.011 + JITTER - 1e-6, start)
    assert not look.too_late("w", "m", start + 0.011 + JITTER + 1e-6, start)
    opens, closes = start + 0.010 - 2 * JITTER, start + 0.012 + 2 * JITTER  # end -/+ lead
    assert look.update("m", opens - 1e-4) == ([], [])
    assert look.update("m", opens + 1e-4) == (["w"], []) and look.is_open("w", "m")
    assert look.update("m", closes + 1e-4) == ([], ["w"])  # the prediction has passed
    look.forget_worker("w")
    assert not look.active and not look.is_open("w", "m")


def test_a_more_urgent_request_goes_ahead_of_a_staged_one_once_per_complete(h: Harness) -> None:
    h.enqueue("b")  # running, predicted to end at t0 + 11 ms
    h.enqueue("low", priority=2)
    h.advance(9.6 * MS)
    assert h.granted_ids()[STEADY:] == ["b", "low"]  # staged
    h.enqueue("urgent", "second", priority=0)  # more urgent than "low", which has not started
    grants = {g.request_id: g for g in h.grants()}
    assert grants["urgent"].front and grants["urgent"].worker_id == "w1"
    assert not grants["low"].front and "second" not in grants  # one per slot until its Complete
    h.complete("b", inference_ms=10.0)  # "urgent" runs now; "low" has still not started
    grants = {g.request_id: g for g in h.grants()}
    assert grants["second"].front
    h.complete("urgent", inference_ms=10.0)
    h.complete("second", inference_ms=10.0)
    h.complete("low", inference_ms=10.0)
    h.check(settled=True)


def test_no_front_once_the_staged_request_has_started(h: Harness) -> None:
    h.enqueue("b")
    h.enqueue("low", priority=2)
    h.advance(9.6 * MS)
    h.clock.advance(2 * MS)  # past b's predicted end: "low" is running by now
    h.enqueue("urgent", priority=0)
    assert "urgent" not in h.granted_ids()


def test_no_front_when_it_would_reach_the_worker_after_the_staged_request_started(h: Harness) -> None:
    """A front grant that arrives once "low" runs would queue ahead of anything waiting there,
    an earlier front grant too, which would then run a service time late."""
    t0 = h.clock.monotonic()
    h.enqueue("b")  # running, predicted to end at t0 + 11 ms
    h.enqueue("low", priority=2)
    h.advance(9.6 * MS)
    h.clock.advance((10.5 - 9.6) * MS)  # b ends in 0.5 ms; a grant takes 1 ms to reach the worker
    assert h.clock.monotonic() < t0 + 11 * MS
    h.enqueue("urgent", priority=0)
    assert "urgent" not in h.granted_ids()
    h.complete("b", inference_ms=10.0)
    h.complete("low", inference_ms=10.0)
    assert h.granted_ids()[-1] == "urgent"  # the next free place is its


def test_a_request_staged_behind_another_starts_after_it() -> None:
    look, start = taught()  # the running request ends at start + 11 ms
    look.granted("w", "m", (1, "s1"), start, max_inflight=1)  # staged: runs 11..21 ms
    assert look.too_late("w", "m", start + 0.021 + JITTER - 1e-6, start)
    assert not look.too_late("w", "m", start + 0.021 + JITTER + 1e-6, start)
    # one that goes to the front starts when the running one ends
    assert not look.too_late("w", "m", start + 0.011 + JITTER + 1e-6, start, front=True)


def test_a_staged_request_pushed_past_its_deadline_makes_room_for_another(h: Harness) -> None:
    h.enqueue("b")  # running, predicted to end at t0 + 11 ms
    h.enqueue("low", priority=2, timeout_ms=20.0)
    h.advance(9.6 * MS)
    assert h.granted_ids()[STEADY:] == ["b", "low"]  # staged: starts at ~11 ms, deadline 20
    h.enqueue("urgent", priority=0)  # ahead of "low", which now could start only at ~21 ms
    h.enqueue("next", priority=2)
    assert h.granted_ids()[STEADY:] == ["b", "low", "urgent"]
    h.advance(2.4 * MS)
    h.complete("b", inference_ms=10.0)  # at t0 + 12: "urgent" runs until ~21
    h.advance((21 - 1 - 0.5 - 12 + 0.1) * MS)
    # the window for the end of "urgent": "low" will be refused there, so "next" is staged
    # behind it rather than the slot idling for a dispatch round trip after "low"'s refusal
    assert h.granted_ids()[STEADY:] == ["b", "low", "urgent", "next"]
    h.advance(2 * MS)
    h.complete("urgent", inference_ms=10.0)
    h.complete("low", error=errors_pb2.ERROR_CODE_EXPIRED)
    h.complete("next", inference_ms=10.0)
    h.check(settled=True)


def test_a_request_that_starts_on_arrival_is_late_only_by_the_send_path() -> None:
    """The inference time's deviation says nothing about when a request reaches a free slot:
    a model whose requests take 1 ms or 100 ms must not have its requests expired up front."""
    look = Lookahead(margin_s=0.0)
    for n in range(20):
        key = (1, f"r{n}")
        inference_s = 0.001 if n % 2 else 0.100
        look.granted("w", "m", key, 0.0, max_inflight=1)
        look.completed(key, inference_s + 0.002, inference_ms=inference_s * 1000)  # 1 ms each way
    assert not look.active  # nothing granted: the slot is free
    assert not look.too_late("w", "m", 0.0 + 0.001 + 0.0005, 0.0)
    assert look.too_late("w", "m", 0.0 + 0.001 - 0.0005, 0.0)  # it cannot get there in time


def test_batch_optimized_never_stages_nor_wakes_for_windows(h: Harness) -> None:
    h.core.set_ordering(make_ordering("batch_optimized", batch=BatchRule(max_batch_size=2, max_wait_s=0.005)))
    t0 = h.clock.monotonic()
    h.enqueue("b", "c")  # a full group: b runs, c waits for the slot
    assert h.granted_ids()[STEADY:] == ["b"]
    h.advance(6 * MS)  # past c's group wait; the slot is still busy
    assert h.core.next_deadline() == pytest.approx(t0 + 1.0)  # c's TTL: no lookahead window
    h.advance(3.6 * MS)
    assert h.granted_ids()[STEADY:] == ["b"]  # nothing staged behind b
    h.complete("b", inference_ms=10.0)
    assert h.granted_ids()[STEADY:] == ["b", "c"]
