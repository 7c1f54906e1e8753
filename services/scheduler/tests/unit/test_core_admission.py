"""Admission, ordering, overflow, cancel and expiry in the core."""

from __future__ import annotations

from typing import TYPE_CHECKING

from loadmaster.scheduler.domain import Grant, OverflowPolicy, Reject, RequestInfo, SlotState, Submission
from loadmaster.v1 import errors_pb2

if TYPE_CHECKING:
    from conftest import Harness, MakeHarness

READY = SlotState.READY


def test_no_worker_connected_is_unavailable(h: Harness) -> None:
    h.enqueue("r1")
    [reject] = h.take()
    assert isinstance(reject, Reject)
    assert reject.error_code == errors_pb2.ERROR_CODE_UNAVAILABLE
    assert "no model-pool worker connected" in reject.message
    h.check(settled=True)


def test_unknown_model_is_not_found_naming_it(h: Harness) -> None:
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("r1", model="nope")
    [reject] = h.take()
    assert isinstance(reject, Reject)
    assert reject.error_code == errors_pb2.ERROR_CODE_NOT_FOUND
    assert "'nope'" in reject.message
    h.check(settled=True)


def test_grant_carries_worker_slot_generation_and_deadline(h: Harness) -> None:
    h.worker("w1", ["m"])
    h.report("w1", {"m": READY}, gen=7)
    h.enqueue("r1", timeout_ms=250)
    [grant] = h.take()
    assert grant == Grant(
        request_id="r1",
        worker_id="w1",
        data_endpoint="tcp://w1:5556",
        generation=7,
        deadline_unix_ns=int((h.clock.time() + 0.25) * 1e9),
        attempt=1,
    )
    h.complete("r1")
    h.check(settled=True)


def test_ordering_priority_then_urgency_then_arrival(h: Harness) -> None:
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("busy")  # takes the only slot (max_inflight 1)
    h.enqueue("p1", priority=1, urgency=0.9)
    h.enqueue("p0-low-a", priority=0, urgency=0.1)
    h.enqueue("p2", priority=2, urgency=1.0)
    h.enqueue("p0-high", priority=0, urgency=0.8)
    h.enqueue("p0-low-b", priority=0, urgency=0.1)
    current = "busy"
    order = []
    for _ in range(5):
        h.complete(current)
        current = h.grants()[-1].request_id
        order.append(current)
    assert order == ["p0-high", "p0-low-a", "p0-low-b", "p1", "p2"]
    h.complete(current)
    h.check(settled=True)


def test_one_batch_is_ordered_before_it_is_dispatched(h: Harness) -> None:
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue_batch([RequestInfo("a", "m", priority=5), RequestInfo("b", "m", priority=0)])
    assert h.granted_ids() == ["b"]


def test_reject_newest_refuses_the_new_request(make_harness: MakeHarness) -> None:
    h = make_harness(max_queue_size=2, overflow_policy=OverflowPolicy.REJECT_NEWEST)
    h.worker("w1", ["m"])  # nothing READY: everything waits
    h.enqueue("a", "b", "c")
    [reject] = [o for o in h.take() if isinstance(o, Reject)]
    assert (reject.request_id, reject.error_code) == ("c", errors_pb2.ERROR_CODE_OVERFLOW)
    [stats] = h.core.queue_stats()
    assert (stats.depth, stats.overflowed) == (2, 1)
    h.check()


def test_drop_oldest_admits_the_new_one_and_rejects_the_oldest(make_harness: MakeHarness) -> None:
    h = make_harness(max_queue_size=2, overflow_policy=OverflowPolicy.DROP_OLDEST)
    h.worker("w1", ["m"])
    h.enqueue("old", priority=0)  # the oldest goes, even though it ranks first
    h.enqueue("mid", priority=5)
    h.enqueue("new", priority=9)
    [reject] = [o for o in h.take() if isinstance(o, Reject)]
    assert (reject.request_id, reject.error_code) == ("old", errors_pb2.ERROR_CODE_OVERFLOW)
    assert "full" in reject.message
    h.report("w1", {"m": READY})
    h.complete("mid")
    assert h.granted_ids() == ["mid", "new"]
    h.complete("new")
    assert h.core.queue_stats()[0].overflowed == 1
    h.check(settled=True)


def test_ttl_expiry_rejects_exactly_the_due_requests(make_harness: MakeHarness) -> None:
    h = make_harness(request_ttl_ms=1000.0)
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("busy")
    h.enqueue("short", timeout_ms=100)
    h.enqueue("mid", timeout_ms=300)
    h.enqueue("ttl", timeout_ms=5000)  # a client timeout can only lower the TTL
    h.take()
    start = h.clock.monotonic()
    assert h.core.next_deadline() == start + 0.1
    h.advance(0.099)
    assert h.take() == []
    h.advance(0.001)
    [expired] = h.take()
    assert isinstance(expired, Reject)
    assert (expired.request_id, expired.error_code) == ("short", errors_pb2.ERROR_CODE_EXPIRED)
    assert h.core.next_deadline() == start + 0.3
    h.advance(0.5)
    assert [r.request_id for r in h.take()] == ["mid"]
    assert h.core.next_deadline() == start + 1.0
    h.advance(0.5)
    assert [r.request_id for r in h.take()] == ["ttl"]
    assert h.core.next_deadline() is None
    assert h.core.queue_stats()[0].expired == 3
    h.complete("busy")  # a granted request is the worker's to time out
    h.check(settled=True)


def test_an_expired_head_is_rejected_not_granted(h: Harness) -> None:
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("busy")
    h.enqueue("late", timeout_ms=10)
    h.enqueue("fine")
    h.clock.advance(0.02)  # the timer has not fired yet
    h.complete("busy")
    assert [(type(o).__name__, o.request_id) for o in h.take()] == [
        ("Grant", "busy"),
        ("Reject", "late"),
        ("Grant", "fine"),
    ]
    h.complete("fine")
    h.check(settled=True)


def test_cancel_removes_a_queued_request_silently_and_ignores_others(h: Harness) -> None:
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("busy", "waiting")
    h.cancel("waiting")
    h.cancel("busy")  # granted: ignored
    h.core.submit(1, Submission(cancels=["never-seen"]))
    h.complete("busy")
    assert h.granted_ids() == ["busy"]
    assert h.rejects() == []
    assert h.core.next_deadline() is None
    h.check(settled=True)


def test_a_duplicate_request_id_is_refused_without_touching_the_first(h: Harness) -> None:
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("r1")
    h.take()
    h.core.submit(1, Submission(enqueues=[RequestInfo("r1", "m")]))
    [reject] = h.take()
    assert isinstance(reject, Reject)
    assert reject.error_code == errors_pb2.ERROR_CODE_INVALID_ARGUMENT
    assert h.core.queue_stats()[0].inflight == 1
    h.complete("r1")
    assert h.core.queue_stats()[0].inflight == 0


def test_same_request_id_in_two_sessions_are_two_requests(h: Harness) -> None:
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("r1", session=1)
    h.enqueue("r1", session=2)
    h.complete("r1", session=1)
    assert [(s, o.request_id) for s, o in h.outcomes] == [(1, "r1"), (2, "r1")]
    h.complete("r1", session=2)
    h.check(settled=True)
