"""Shares split between gateways (docs/data-path.md "Shares between gateways"): several
gateways using one model each hold part of its slots, with a local queue, in
proportion to the demand they report (their calls waiting or running, on average), measured
again every `share_period_s`; a request that waits in
the scheduler reclaims one slot, never the whole share, and lending never pauses. On the
core with a fake clock: one worker, 4 slots, a 1 s window, a 0.5 s period."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import pytest

from loadmaster.scheduler.domain import Submission
from loadmaster.v1 import errors_pb2

if TYPE_CHECKING:
    from conftest import Harness, MakeHarness

A, B = 1, 2
SLOTS = 4
PERIOD_S = 0.5


@pytest.fixture
def h(make_harness: MakeHarness) -> Harness:
    h = make_harness(
        max_inflight=lambda model_id: SLOTS, dispatch_credits=64, credit_window_s=1.0, share_period_s=0.5
    )
    h.core.accept_credits(A)
    h.core.accept_credits(B)
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("a0", session=A)
    h.complete("a0", session=A)
    assert _shares(h) == {A: SLOTS}
    assert all(c.local_queue is not None for _, c in h.lent.values())  # the whole share, queued locally
    return h


def _shares(h: Harness) -> dict[int, int]:
    """Credits each session holds, not revoked."""
    return dict(Counter(s for cid, (s, _) in h.lent.items() if cid not in h.revoked))


def _return_revoked(h: Harness) -> None:
    """Each gateway hands back what was revoked from it (its calls on them have ended)."""
    for cid in list(h.revoked):
        if cid in h.lent:
            h.return_credit(cid, session=h.lent[cid][0])
    h.revoked.clear()


def _demand(h: Harness, a_calls: float, b_calls: float, *, waiting: int = 0) -> None:
    """Each gateway reports its demand over the last period: `*_calls` calls on average waiting
    in its local queue or running on its credits."""
    for session, calls in ((A, a_calls), (B, b_calls)):
        h.core.submit(session, Submission(local_depths=[("m", waiting, calls * PERIOD_S)]))


def _periods(h: Harness, a_calls: float, b_calls: float, *, n: int = 4) -> None:
    """`n` share periods with this demand, each gateway handing back what is revoked from it."""
    for _ in range(n):
        _demand(h, a_calls, b_calls)
        h.advance(PERIOD_S)
        _return_revoked(h)


def _second_gateway_arrives(h: Harness) -> None:
    """B's first request waits here and reclaims one of A's slots; once A hands it back the slot
    is lent to B (no pause), and the request goes back to B's local queue to run on it."""
    h.enqueue("b0", session=B)
    assert len(h.revoked) == 1 and "b0" not in h.granted_ids()
    _return_revoked(h)
    [reject] = [r for r in h.rejects() if r.request_id == "b0"]
    assert reject.use_share
    assert _shares(h) == {A: SLOTS - 1, B: 1}
    assert all(c.local_queue is not None for s, c in h.lent.values() if s == B)
    [credit] = [cid for cid, (s, _) in h.lent.items() if s == B]
    h.run("b0.run", credit, session=B)
    h.complete("b0.run", session=B)


def test_two_busy_gateways_split_the_slots_by_their_demand(h: Harness) -> None:
    _second_gateway_arrives(h)
    _periods(h, 4, 4)  # equal demand: 2 and 2 within a few periods
    assert _shares(h) == {A: 2, B: 2}
    _periods(h, 6, 2)  # A's demand grows to 3 times B's: 3 and 1
    assert _shares(h) == {A: 3, B: 1}
    h.check()


def test_a_late_request_of_a_share_holder_goes_back_to_its_local_queue(h: Harness) -> None:
    _second_gateway_arrives(h)
    holder = next(s for s, n in _shares(h).items() if n)
    before = _shares(h)
    h.enqueue("late", session=holder)
    [reject] = [r for r in h.rejects() if r.request_id == "late"]
    assert reject.use_share and _shares(h) == before and h.revoked == []


def test_a_sparse_gateway_keeps_one_slot_and_the_busy_one_gets_the_rest(h: Harness) -> None:
    """B sends now and then (a priority-0 control loop, say), A keeps its queue full: B's part by
    demand rounds to 0, but it keeps one slot, so its calls run at once instead of each
    reclaiming one (docs/data-path.md measures both)."""
    _second_gateway_arrives(h)
    _periods(h, 6, 0.02)
    assert _shares(h) == {A: SLOTS - 1, B: 1}
    h.check()


def test_with_more_gateways_than_slots_the_least_demand_gets_none_and_reclaims(
    make_harness: MakeHarness,
) -> None:
    h = make_harness(max_inflight=lambda model_id: 2, dispatch_credits=64, credit_window_s=1.0)
    for session in (A, B, 3):
        h.core.accept_credits(session)
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("a0", session=A)
    h.complete("a0", session=A)
    for session in (B, 3):  # each newcomer has a slot reclaimed for it and lent
        h.enqueue(f"first-{session}", session=session)
        _return_revoked(h)
    for _ in range(3):
        for session, calls in ((A, 4.0), (B, 2.0), (3, 0.1)):
            h.core.submit(session, Submission(local_depths=[("m", 0, calls * PERIOD_S)]))
        h.advance(PERIOD_S)
        _return_revoked(h)
    assert _shares(h) == {A: 1, B: 1}  # 2 slots: none left for the third, smallest demand
    h.enqueue("late", session=3)  # its call reclaims one: lent to it once handed back
    assert len(h.revoked) == 1
    _return_revoked(h)
    assert _shares(h).get(3) == 1
    assert [r.use_share for r in h.rejects() if r.request_id == "late"] == [True]
    h.check()


def test_a_gateway_that_goes_quiet_gives_its_share_back(h: Harness) -> None:
    _second_gateway_arrives(h)
    _periods(h, 3, 3)
    assert _shares(h) == {A: 2, B: 2}
    for _ in range(4):  # only A uses the model: past the window B is no borrower any more
        h.core.submit(A, Submission(local_depths=[("m", 0, 2 * PERIOD_S)]))
        h.advance(0.5)
        _return_revoked(h)
    assert _shares(h) == {A: SLOTS}
    assert h.core.next_deadline() is None  # whole again: nothing left to measure


def test_a_closed_session_frees_its_share_for_the_others(h: Harness) -> None:
    _second_gateway_arrives(h)
    _periods(h, 3, 3)
    h.close_session(B)
    for cid in [cid for cid, (s, _) in h.lent.items() if s == B]:
        del h.lent[cid]  # the session's credits die with it
    h.advance(0.5)
    _return_revoked(h)
    assert _shares(h) == {A: SLOTS}


def test_a_retry_is_granted_here_with_its_attempts_counted(h: Harness) -> None:
    """A credit run that failed retryably is granted again here, with attempt 2, not handed back
    to a local queue, where its attempts would start over."""
    _second_gateway_arrives(h)
    [credit] = [cid for cid, (s, _) in h.lent.items() if s == B]
    h.finished("r", credit, session=B, error=errors_pb2.ERROR_CODE_UNAVAILABLE, retryable=True)
    h.return_credit(credit, session=B)  # a worker failure hands the credit back
    if "r" not in h.granted_ids():
        assert len(h.revoked) == 1  # a slot reclaimed for it
        _return_revoked(h)
    assert "r" in h.granted_ids()
    assert "r" not in [r.request_id for r in h.rejects()]
    h.check()
