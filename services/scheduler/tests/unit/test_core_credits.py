"""Dispatch credits in the core: lending free slots to a model's only gateway, runs on them,
and the slot accounting through all of it, for credits with a local queue (the default
strategy's) and without one. Credits without one (here: a `latest_only` model's) follow the
old rule: a sole borrower only, and every credit revoked the moment a request waits."""

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


def _harness(make_harness: MakeHarness, *, local_queue: bool) -> Harness:
    """Two slots on one worker, up to two credits per model; session 1 accepts credits. Without
    `local_queue` the model is `latest_only`, whose credits carry no `LocalQueueSpec` (its
    clients here send one request at a time, so nothing is superseded)."""
    overrides: dict[str, object] = {}
    if not local_queue:
        overrides["model_policy"] = lambda model_id: ModelPolicy(
            100, 1000.0, OverflowPolicy.REJECT_NEWEST, latest_only=True, dispatch_credits=2
        )
    h = make_harness(max_inflight=lambda model_id: 2, dispatch_credits=2, credit_window_s=1.0, **overrides)
    h.core.accept_credits(1)
    h.worker("w1", ["m"], ready=["m"])
    return h


@pytest.fixture(params=[True, False], ids=["local_queue", "plain"])
def h(make_harness: MakeHarness, request: pytest.FixtureRequest) -> Harness:
    """Credits with a local queue, or without one: a test runs with both unless it says `PLAIN`."""
    return _harness(make_harness, local_queue=request.param)


# The old rule, which only credits without a local queue follow.
PLAIN = pytest.mark.parametrize("h", [False], ids=["plain"], indirect=True)


@pytest.mark.parametrize("local_queue", [True, False], ids=["local_queue", "plain"])
def test_the_credits_carry_a_local_queue_unless_the_model_is_latest_only(
    make_harness: MakeHarness, local_queue: bool
) -> None:
    """A gateway's local queue never supersedes, so a `latest_only` model's credits carry no
    spec; the default strategy's do, the model's calls unmeasured (the two paths tested here)."""
    h = _harness(make_harness, local_queue=local_queue)
    h.enqueue("a")
    h.complete("a")
    specs = [c.local_queue for _, c in h.lent.values()]
    assert len(specs) == 2 and all((spec is not None) == local_queue for spec in specs)


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


@PLAIN
def test_no_credits_while_two_gateways_use_the_model(h: Harness) -> None:
    h.core.accept_credits(2)
    h.enqueue("a", session=1)  # session 1 alone so far: the free slot is lent to it
    assert [entry[0] for entry in h.lent.values()] == [1]
    h.enqueue("b", session=2)  # no slot free: waits, and session 1's credit is revoked
    assert h.revoked == list(h.lent)
    h.return_credit(h.revoked[0])
    h.complete("a", session=1)
    h.complete("b", session=2)
    assert h.lent == {}  # two recent users: nothing is lent
    h.clock.advance(1.5)  # session 2 goes quiet past the window
    h.enqueue("c", session=1)
    h.complete("c", session=1)
    assert len(h.idle_credits()) == 2
    h.check(settled=True)


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


@PLAIN
def test_a_waiting_request_revokes_the_credits_and_is_granted_once_they_are_returned(h: Harness) -> None:
    h.enqueue("a")
    h.complete("a")
    c1, c2 = sorted(h.idle_credits())
    h.run("r1", c1)
    h.enqueue("x", session=1)  # both slots lent: it waits, and the credits are revoked
    assert "x" not in h.granted_ids()
    assert sorted(h.revoked) == [c1, c2]
    h.return_credit(c2)  # idle: the gateway returns it at once
    assert h.granted_ids()[-1] == "x"
    h.complete("r1")  # the run ends; the gateway returns its revoked credit
    h.return_credit(c1)
    [stats] = h.core.queue_stats()
    assert stats.inflight == 1  # only "x" holds a slot now
    h.complete("x")
    assert len(h.lent) == 0  # lending is paused for the window after a revocation
    h.clock.advance(1.1)
    h.enqueue("y")
    h.complete("y")
    assert len(h.idle_credits()) == 2
    h.check(settled=True)


@PLAIN
def test_a_run_on_a_credit_the_core_no_longer_holds_is_queued_and_granted(h: Harness) -> None:
    h.enqueue("a")
    h.complete("a")
    credit = h.idle_credits()[0]
    h.return_credit(credit)  # the freed slot is lent again at once (the queue is empty)
    relent = sorted(h.idle_credits())
    h.run("r1", credit)  # raced with its own return: queued like any other request
    assert sorted(h.revoked) == relent  # ... which revokes the credits
    for other in relent:
        h.return_credit(other)
    [grant] = [g for g in h.grants() if g.request_id == "r1"]
    assert (grant.worker_id, grant.attempt) == ("w1", 1)
    h.complete("r1")
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


@PLAIN
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


@PLAIN
def test_a_finished_run_that_failed_retryably_is_granted_again(h: Harness) -> None:
    h.enqueue("a")
    h.complete("a")
    c1, c2 = sorted(h.idle_credits())
    h.finished("r1", c1, error=UNAVAILABLE, retryable=True)
    assert sorted(h.revoked) == [c1, c2]  # r1 waits in the queue again
    h.return_credit(c1)  # as the gateway does after a retryable failure on a credit
    [grant] = [g for g in h.grants() if g.request_id == "r1"]
    assert (grant.worker_id, grant.attempt) == ("w1", 2)
    h.complete("r1")
    h.return_credit(c2)
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
