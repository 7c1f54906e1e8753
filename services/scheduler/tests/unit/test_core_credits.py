"""Dispatch credits in the core: lending free slots to a model's only gateway, runs on them,
and the slot accounting through all of it (test_core_local_queue.py has the local queues the
credits carry; test_core_split_shares.py, several gateways)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from loadmaster.common.ordering import make_ordering
from loadmaster.scheduler.config import ModelPolicy
from loadmaster.scheduler.domain import (
    Completion,
    CreditRun,
    FinishedRun,
    OverflowPolicy,
    RequestInfo,
    SlotState,
    Submission,
)
from loadmaster.v1 import errors_pb2

if TYPE_CHECKING:
    from conftest import Harness, MakeHarness

READY = SlotState.READY
UNAVAILABLE = errors_pb2.ERROR_CODE_UNAVAILABLE


@pytest.fixture
def h(make_harness: MakeHarness) -> Harness:
    """Two slots on one worker, up to two credits per model; session 1 accepts credits."""
    h = make_harness(max_inflight=lambda model_id: 2, dispatch_credits=2, credit_window_s=1.0)
    h.core.accept_credits(1)
    h.worker("w1", ["m"], ready=["m"])
    return h


@pytest.mark.parametrize("model", ["latest_only", "cap_below_slots"])
def test_a_model_whose_order_a_gateway_cannot_keep_is_never_lent(
    make_harness: MakeHarness, model: str
) -> None:
    """Every credit carries a local queue's spec; a `latest_only` model (a gateway's queue never
    supersedes), or one with more slots than `dispatch_credits`, is ordered here, every call."""
    policy = ModelPolicy(
        100,
        1000.0,
        OverflowPolicy.REJECT_NEWEST,
        latest_only=model == "latest_only",
        dispatch_credits=2 if model == "latest_only" else 1,
    )
    h = make_harness(
        max_inflight=lambda model_id: 2, credit_window_s=1.0, model_policy=lambda model_id: policy
    )
    h.core.accept_credits(1)
    h.worker("w1", ["m"], ready=["m"])
    for request_id in ("a", "b", "c"):
        h.enqueue(request_id)
        h.complete(request_id)
    assert h.lent == {} and h.granted_ids() == ["a", "b", "c"]


def test_a_sole_gateway_gets_the_free_slots_once_the_queue_is_empty(h: Harness) -> None:
    assert h.lent == {}  # nobody has used the model yet
    h.enqueue("a")
    assert h.granted_ids() == ["a"]
    # One slot free after the grant: lent at once; the second when "a" completes.
    assert len(h.lent) == 1
    h.complete("a")
    assert sorted(h.idle_credits()) == ["c1", "c2"]
    [stats] = h.core.queue_stats()
    assert (stats.inflight, stats.credits) == (0, 2)
    h.enqueue("x", session=1)  # lent slots count against max_inflight: x is not granted
    assert "x" not in h.granted_ids()


def test_no_credits_for_a_gateway_that_does_not_accept_them(make_harness: MakeHarness) -> None:
    h = make_harness(max_inflight=lambda model_id: 2, dispatch_credits=2)
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("a")
    h.complete("a")
    assert h.lent == {}


def test_a_run_on_a_credit_is_tracked_and_its_slot_stays_lent(h: Harness) -> None:
    h.enqueue("a")
    h.complete("a")
    credit = h.idle_credits()[0]
    h.run("r1", credit, client="robot")
    assert h.state("r1") == "granted"
    [stats] = h.core.queue_stats()
    assert (stats.granted, stats.inflight, stats.credits, stats.depth) == (2, 1, 1, 0)
    assert h.core.active_clients == 1
    h.complete("r1")
    assert credit in h.idle_credits()  # still lent, idle again
    h.run("r2", credit)  # and usable again
    assert h.state("r2") == "granted"
    h.complete("r2")
    h.check(settled=True)


def test_a_run_on_a_credit_the_core_no_longer_holds_is_sent_back_to_its_gateway(h: Harness) -> None:
    """Raced with its own return: the gateway holds the model's share again, so the run is
    answered `use_share`, which a gateway ignores for a call it already sent; nothing runs it
    twice and nothing waits here."""
    h.enqueue("a")
    h.complete("a")
    credit = h.idle_credits()[0]
    h.return_credit(credit)  # the freed slot is lent again at once (the queue is empty)
    h.run("r1", credit)
    assert [(r.request_id, r.use_share) for r in h.rejects()] == [("r1", True)]
    assert "r1" not in h.granted_ids() and h.revoked == []
    [stats] = h.core.queue_stats()
    assert (stats.depth, stats.credits) == (0, 2)
    h.check(settled=True)


def test_a_credit_returned_mid_run_keeps_the_run_counted_until_it_completes(
    make_harness: MakeHarness,
) -> None:
    h = make_harness(max_inflight=lambda model_id: 1, dispatch_credits=1)
    h.core.accept_credits(1)
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("a")
    h.complete("a")
    [credit] = h.idle_credits()
    h.run("r1", credit)
    h.return_credit(credit)  # returned while r1 still runs
    h.enqueue("x", session=1)
    assert "x" not in h.granted_ids()  # r1 still holds the only slot
    h.complete("r1")
    assert h.granted_ids()[-1] == "x"
    h.complete("x")
    h.check(settled=True)


def test_calls_staged_behind_a_run_are_tracked_on_its_credit(h: Harness) -> None:
    """A gateway stages calls behind a busy credit's run (LocalQueue.stage): each is admitted
    on the credit, a retryable failure of one is granted again, and the credit is idle only
    once all have ended (a slot may be reclaimed for the retry meanwhile)."""
    h.worker("w2", ["m"])  # not READY yet
    h.enqueue("a")
    h.complete("a")
    c1, _ = sorted(h.idle_credits())
    h.run("r1", c1)
    h.run("r2", c1)  # staged behind r1 at w1
    assert (h.state("r1"), h.state("r2")) == ("granted", "granted")
    assert c1 not in h.idle_credits()
    h.complete("r1")
    assert c1 not in h.idle_credits()  # r2 still on it
    h.report("w2", {"m": READY})
    h.complete("r2", error=UNAVAILABLE, retryable=True)
    assert [g.request_id for g in h.grants()].count("r2") == 1  # granted again, here
    assert not h.lent[c1][1].running  # nothing runs on the credit any more
    h.complete("r2")
    h.check(settled=True)


def test_losing_the_worker_requeues_runs_on_its_credits(h: Harness) -> None:
    h.worker("w2", ["m"])  # not READY yet
    h.enqueue("a")
    h.complete("a")
    c1, c2 = sorted(h.idle_credits())
    h.run("r1", c1)
    h.report("w2", {"m": READY})
    h.lose_worker("w1")
    assert {c1, c2} <= set(h.revoked)
    [grant] = [g for g in h.grants() if g.request_id == "r1"]
    assert (grant.worker_id, grant.attempt) == ("w2", 2)
    h.complete("r1")
    h.check(settled=True)


def test_a_reload_at_a_new_generation_revokes_the_old_credits(h: Harness) -> None:
    h.enqueue("a")
    h.complete("a")
    lent = sorted(h.idle_credits())
    h.report("w1", {"m": READY}, gen=2)
    assert sorted(h.revoked) == lent


def test_closing_the_session_frees_its_lent_slots(h: Harness) -> None:
    h.enqueue("a")
    h.complete("a")
    h.close_session(1)
    [stats] = h.core.queue_stats()
    assert stats.inflight == 0
    h.enqueue("b", "c", session=2)
    assert h.granted_ids()[-2:] == ["b", "c"]


def test_switching_to_batch_optimized_revokes_every_credit(h: Harness) -> None:
    h.enqueue("a")
    h.complete("a")
    lent = sorted(h.idle_credits())
    h.core.set_ordering(make_ordering("batch_optimized"))
    assert sorted(h.revoked) == lent


def test_a_run_reported_after_it_ended_counts_as_run_and_completed(h: Harness) -> None:
    h.enqueue("a")
    h.complete("a")
    credit = h.idle_credits()[0]
    h.finished("r1", credit, client="robot")
    assert h.state("r1") == "done"
    assert credit in h.idle_credits() and h.revoked == []  # still lent, idle, usable
    [stats] = h.core.queue_stats()
    assert (stats.granted, stats.inflight, stats.credits, stats.depth) == (2, 0, 2, 0)
    assert h.core.active_clients == 1
    h.run("r2", credit)
    assert h.state("r2") == "granted"
    h.complete("r2")
    h.check(settled=True)


def test_a_finished_run_on_a_credit_the_core_no_longer_holds_is_not_run_again(h: Harness) -> None:
    h.enqueue("a")
    h.complete("a")
    credit = h.idle_credits()[0]
    h.return_credit(credit)  # raced with its own return
    h.finished("r1", credit)
    assert "r1" not in h.granted_ids() and h.rejects() == []
    assert h.revoked == []  # nothing waited in the queue
    [stats] = h.core.queue_stats()
    assert (stats.depth, stats.inflight, stats.credits) == (0, 0, 2)  # nothing queued or running
    h.check(settled=True)


def test_a_finished_run_that_failed_retryably_is_granted_again(h: Harness) -> None:
    h.enqueue("a")
    h.complete("a")
    c1, c2 = sorted(h.idle_credits())
    h.finished("r1", c1, error=UNAVAILABLE, retryable=True)
    assert h.revoked == [c1]  # r1 waits here again (its attempts are counted here): a slot is reclaimed
    h.return_credit(c1)
    [grant] = [g for g in h.grants() if g.request_id == "r1"]
    assert (grant.worker_id, grant.attempt) == ("w1", 2)
    assert c2 in h.idle_credits()
    h.complete("r1")
    h.check(settled=True)


def test_a_message_applies_finished_runs_before_returning_their_credit(h: Harness) -> None:
    h.enqueue("a")
    h.complete("a")
    credit = h.idle_credits()[0]
    run = CreditRun(credit, RequestInfo("r1", "m"))
    h.core.submit(
        1, Submission(finished=[FinishedRun(run, Completion("r1", worker_id="w1"))], returns=[credit])
    )
    assert "r1" not in h.granted_ids() and h.rejects() == []
    [stats] = h.core.queue_stats()
    assert (stats.depth, stats.granted) == (0, 2)  # run on the credit, not queued


def test_a_late_reported_run_keeps_its_clients_cadence(h: Harness) -> None:
    """Runs that reach the core together, reported after the gateway's report delay, still
    give the client's cadence from when they reached the gateway."""
    h.enqueue("a")
    h.complete("a")
    credit = h.idle_credits()[0]
    now_ns = int(h.clock.time() * 1e9)
    for n in range(4):  # arrived 30 ms apart; all reported now
        sent_ns = now_ns - (3 - n) * 30_000_000
        h.finished(f"r{n}", credit, client="robot", received_unix_ns=sent_ns)
    cadence_ms = h.core._clients.cadence_ms("robot")
    assert cadence_ms == pytest.approx(30.0, rel=0.01)
