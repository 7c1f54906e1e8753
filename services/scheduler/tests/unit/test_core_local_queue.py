"""The whole share: a model's only gateway is lent every free slot, with a `LocalQueueSpec` so it
queues its own waiting requests (docs/data-path.md); anything that breaks "whole" or "only"
takes the share back."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from loadmaster.common.ordering import InferenceRequest, make_ordering, register_policy
from loadmaster.scheduler.config import ModelPolicy
from loadmaster.scheduler.domain import OverflowPolicy, RunTally, SlotState, Submission

if TYPE_CHECKING:
    from conftest import Harness, MakeHarness

READY = SlotState.READY
A, B = 1, 2


@pytest.fixture
def h(make_harness: MakeHarness) -> Harness:
    """4 slots per worker, a cap far above them; session A accepts credits and uses the model."""
    h = make_harness(
        max_inflight=lambda model_id: 4,
        dispatch_credits=64,
        credit_window_s=1.0,
        default_latency_budget_ms=40.0,
        client_latency_budgets_ms={"robot": 5.0},
        max_queue_size=7,
        overflow_policy=OverflowPolicy.REJECT_NEWEST,
    )
    h.core.accept_credits(A)
    h.core.accept_credits(B)
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("a0", session=A)
    h.complete("a0", session=A)
    return h


def _share(h: Harness, session: int = A) -> list[str]:
    return sorted(cid for cid, (s, _) in h.lent.items() if s == session and cid not in h.revoked)


def _latest_spec(h: Harness, session: int = A):  # type: ignore[no-untyped-def]
    """The spec of the credit lent last: the gateway queues by it."""
    return h.lent[max(_share(h, session), key=lambda cid: int(cid[1:]))][1].local_queue


def test_the_only_gateway_gets_every_free_slot_and_how_to_queue_for_the_model(h: Harness) -> None:
    assert len(_share(h)) == 4
    spec = _latest_spec(h)
    assert spec is not None
    assert spec.strategy == "model_deadline"
    assert (spec.latency_budget_ms, dict(spec.client_latency_budget_ms)) == (40.0, {"robot": 5.0})
    assert (spec.max_queue_size, spec.reject_newest) == (7, True)


def test_a_worker_that_becomes_ready_is_lent_to_the_gateway_too(h: Harness) -> None:
    h.worker("w2", ["m"])
    assert len(_share(h)) == 4
    h.report("w2", {"m": READY})
    assert len(_share(h)) == 8
    assert _latest_spec(h) is not None


@pytest.mark.parametrize(
    ("overrides", "stage"),
    [
        ({"lookahead": 1}, 1),
        ({"lookahead": 0}, 0),
        ({"model_policy": lambda m: ModelPolicy(100, 1000.0, OverflowPolicy.REJECT_NEWEST, lookahead=2)}, 2),
    ],
    ids=["lookahead_1", "lookahead_0", "model_lookahead_2"],
)
def test_a_long_model_keeps_its_local_queue_and_its_spec_stages_by_its_lookahead(
    make_harness: MakeHarness, overrides: dict[str, object], stage: int
) -> None:
    """However long its calls are measured (on a grant, on a credit, in a tally), the model's
    credits keep their spec, and the spec tells the gateway to stage the model's `lookahead`
    calls behind a busy slot's running one itself (the scheduler no longer does)."""
    h = make_harness(max_inflight=lambda model_id: 4, **overrides)
    h.core.accept_credits(A)
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("a0", session=A)
    h.complete("a0", session=A, inference_ms=10.0)
    share = _share(h)
    h.finished("a1", share[0], session=A, inference_ms=10.0)
    h.core.submit(A, Submission(tallies=[RunTally("m", "w1", runs=3, inference_ms=150.0)]))
    assert h.revoked == [] and _share(h) == share and len(share) == 4
    specs = [h.lent[cid][1].local_queue for cid in share]
    assert all(spec is not None and spec.stage == stage for spec in specs)
    h.check(settled=True)


def test_slots_the_cap_leaves_unlent_take_the_spec_back(make_harness: MakeHarness) -> None:
    """A gateway queueing locally while a slot it was not lent idles would strand its calls."""
    h = make_harness(max_inflight=lambda model_id: 4, dispatch_credits=4)
    h.core.accept_credits(A)
    h.worker("w1", ["m"], ready=["m"])
    h.worker("w2", ["m"])
    h.enqueue("a0", session=A)
    h.complete(
        "a0",
        session=A,
    )
    share = _share(h)
    assert len(share) == 4 and _latest_spec(h) is not None
    h.report("w2", {"m": READY})  # 4 more slots, none lendable under the cap
    assert sorted(h.revoked) == share


def test_a_second_gateway_that_must_wait_reclaims_one_slot_not_the_share(h: Harness) -> None:
    share = _share(h)
    h.enqueue("b1", session=B)  # every slot is lent to A: b1 waits, one of A's credits is revoked
    assert "b1" not in h.granted_ids()
    assert len(h.revoked) == 1 and h.revoked[0] in share
    h.return_credit(h.revoked[0])
    assert len(_share(h, B)) == 1  # lent to B, and b1 goes back to B's local queue to run on it
    assert [r.use_share for r in h.rejects() if r.request_id == "b1"] == [True]
    assert len(_share(h)) == 3  # A keeps ordering its own requests on the rest


def test_a_strategy_switch_takes_every_credit_back_and_relends_by_the_new_one(h: Harness) -> None:
    share = _share(h)
    h.core.set_ordering(make_ordering("round_robin"))
    assert sorted(h.revoked) == share
    for cid in share:
        h.return_credit(cid)  # each slot returned is lent again at once, by the new strategy
    relent = _share(h)
    assert len(relent) == 4 and {h.lent[cid][1].local_queue.strategy for cid in relent} == {"round_robin"}  # type: ignore[union-attr]


def test_a_queue_formed_under_a_central_strategy_moves_to_the_gateway_after_a_switch(h: Harness) -> None:
    """Under batch_optimized nothing is lent while requests wait here; switched to a strategy a
    gateway keeps at overload, the queue here never empties (lending waits for that), so the
    first slot that frees is lent with a spec and the waiting requests go back to the gateway."""
    share = _share(h)
    h.core.set_ordering(make_ordering("batch_optimized"))
    for cid in share:
        h.return_credit(cid)
    h.clock.advance(2.0)
    ids = [f"r{i}" for i in range(6)]  # 4 slots: 2 wait here
    h.enqueue(*ids, session=A)
    h.clock.advance(0.01)
    h.core.expire_due()  # the batch's wait (5 ms) elapsed: a group of 4 is granted
    granted = [r for r in ids if r in h.granted_ids()]
    assert len(granted) == 4 and not _share(h)
    h.core.set_ordering(make_ordering("model_deadline"))
    h.complete(granted[0], session=A)
    assert len(_share(h)) == 1 and _latest_spec(h) is not None
    handed_back = [r.request_id for r in h.rejects() if r.use_share]
    assert sorted(handed_back) == sorted(set(ids) - set(granted))


@pytest.mark.parametrize(("strategy", "tiers"), [("deadline_aware", ()), ("tiered_deadline", (0, 2))])
def test_the_global_deadline_orders_are_kept_by_the_gateway_per_model(
    h: Harness, strategy: str, tiers: tuple[int, ...]
) -> None:
    """Their scope only orders several models' grants in one dispatch round; within a model
    their keys are the deadline family's, so a share still carries a spec, tiers included
    (checked against the scheduler's own order in tests/integration/test_gateway_order.py)."""
    share = _share(h)
    h.core.set_ordering(make_ordering(strategy, tiers=list(tiers) or None))
    assert sorted(h.revoked) == share
    for cid in share:
        h.return_credit(cid)
    relent = _share(h)
    specs = [h.lent[cid][1].local_queue for cid in relent]
    assert len(relent) == 4 and {(s.strategy, s.tiers) for s in specs if s is not None} == {(strategy, tiers)}


def test_a_registered_policy_travels_in_the_spec(h: Harness) -> None:
    """The gateway imports the same `scheduler.policy_modules` and ranks by the policy too."""
    share = _share(h)

    @register_policy("test-local-queue-policy")
    def flat(request: InferenceRequest) -> float:
        return 10.0

    h.core.set_ordering(make_ordering("model_deadline", policy="test-local-queue-policy"))
    for cid in share:
        h.return_credit(cid)  # each slot returned is lent again at once, with the policy
    relent = _share(h)
    specs = [h.lent[cid][1].local_queue for cid in relent]
    assert len(relent) == 4 and {(s.strategy, s.policy) for s in specs if s is not None} == {
        ("model_deadline", "test-local-queue-policy")
    }


def test_requests_waiting_in_gateways_count_in_the_queue_depth(h: Harness) -> None:
    h.core.submit(A, Submission(local_depths=[("m", 3, 0.0)]))
    h.core.submit(B, Submission(local_depths=[("m", 2, 0.0)]))
    assert [s.depth for s in h.core.queue_stats() if s.model_id == "m"] == [5]
    h.core.submit(A, Submission(local_depths=[("m", 0, 0.0)]))
    h.core.close_session(B)
    assert [s.depth for s in h.core.queue_stats() if s.model_id == "m"] == [0]


def test_the_queue_depth_gauge_counts_the_gateways_queues_after_every_dispatch(h: Harness) -> None:
    h.core.submit(A, Submission(local_depths=[("m", 3, 0.0)]))
    assert h.last_value[("queue_depth", "m")] == 3
    for n in range(5):  # B's requests take the slots left, then wait here
        h.enqueue(f"b{n}", session=B)
    [stats] = [s for s in h.core.queue_stats() if s.model_id == "m"]
    assert stats.depth > 3  # some of B's wait here, beside A's 3
    assert h.last_value[("queue_depth", "m")] == stats.depth  # the gauge and GetQueues agree


def test_tallied_runs_count_as_granted_and_as_use_of_the_model(h: Harness) -> None:
    [before] = [s.granted for s in h.core.queue_stats() if s.model_id == "m"]
    h.core.submit(B, Submission(tallies=[RunTally("m", "w1", runs=5, failed=1, inference_ms=2.0)]))
    assert [s.granted for s in h.core.queue_stats() if s.model_id == "m"] == [before + 5]
    # B used the model too: A is no longer its only user, so nothing more is lent to A
    share = _share(h)
    h.return_credit(share[0])
    assert _share(h) == share[1:]


def test_the_share_holders_own_late_request_is_handed_back_not_queued(h: Harness) -> None:
    """Sent before its gateway got the whole share: waiting here would take that share back."""
    share = _share(h)
    h.enqueue("late", session=A)
    assert h.revoked == [] and _share(h) == share
    [reject] = [r for r in h.rejects() if r.request_id == "late"]
    assert reject.use_share
