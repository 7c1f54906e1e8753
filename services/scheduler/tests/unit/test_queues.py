"""RequestQueues: strategy order, arrival order, deadlines, lazy removal."""

from __future__ import annotations

from loadmaster.common.ordering import PriorityOrdering, make_ordering
from loadmaster.scheduler.domain import Request, RequestInfo
from loadmaster.scheduler.queues import RequestQueues


def _request(
    n: int, *, model: str = "m", priority: int = 0, urgency: float = 0.0, deadline: float = 10.0
) -> Request:
    info = RequestInfo(f"r{n}", model, priority=priority, urgency=urgency)
    return Request(
        key=(1, f"r{n}"), info=info, arrival=n, enqueued_at=0.0, deadline=deadline, deadline_unix_ns=0
    )


def test_priority_ordering_key() -> None:
    ordering = make_ordering("priority")
    assert ordering.name == "priority"
    keys = [
        ordering.key(_request(n, priority=p, urgency=u))
        for n, p, u in [(0, 1, 1.0), (1, 0, 0.2), (2, 0, 0.9)]
    ]
    assert sorted(range(3), key=keys.__getitem__) == [2, 1, 0]


def test_pop_serves_in_strategy_order_per_model() -> None:
    q = RequestQueues(PriorityOrdering())
    q.push(_request(0, priority=2))
    q.push(_request(1, priority=0))
    q.push(_request(2, model="other"))
    q.push(_request(3, priority=0))
    assert q.depth("m") == 3 and q.depth("other") == 1 and len(q) == 4
    assert sorted(q.waiting_models()) == ["m", "other"]
    assert [q.pop("m").request_id for _ in range(3)] == ["r1", "r3", "r0"]  # type: ignore[union-attr]
    assert q.pop("m") is None and q.depth("m") == 0
    assert q.waiting_models() == ["other"]


def test_pop_oldest_ignores_rank() -> None:
    q = RequestQueues(PriorityOrdering())
    q.push(_request(0, priority=0))
    q.push(_request(1, priority=9))
    oldest = q.pop_oldest("m")
    assert oldest is not None and oldest.request_id == "r0"
    assert q.peek("m") is not None and q.peek("m").request_id == "r1"  # type: ignore[union-attr]


def test_remove_is_lazy_and_a_removed_key_can_come_back() -> None:
    q = RequestQueues(PriorityOrdering())
    first = _request(0, deadline=1.0)
    q.push(first)
    q.push(_request(1, deadline=2.0))
    assert q.remove(first.key) is first
    assert q.remove(first.key) is None
    assert first.key not in q
    assert q.next_deadline() == 2.0
    q.push(first)  # a retried request re-enters with its arrival and deadline
    assert q.peek("m") is first
    assert q.next_deadline() == 1.0


def test_pop_expired_takes_exactly_the_due_requests_in_deadline_order() -> None:
    q = RequestQueues(PriorityOrdering())
    for n, deadline in enumerate([3.0, 1.0, 2.0, 2.0, 5.0]):
        q.push(_request(n, deadline=deadline))
    q.remove((1, "r2"))
    assert [r.request_id for r in q.pop_expired(2.0)] == ["r1", "r3"]
    assert q.next_deadline() == 3.0
    assert q.pop_expired(2.9) == []
    assert len(q) == 2


def test_stale_entries_are_compacted() -> None:
    q = RequestQueues(PriorityOrdering())
    keep = _request(100_000, deadline=99.0)
    q.push(keep)
    for n in range(2_000):
        request = _request(n, deadline=1.0 + n)
        q.push(request)
        q.remove(request.key)
    heaps = q._models["m"]
    assert len(heaps.order) < 200 and len(heaps.arrival) < 200
    assert len(q._deadlines) < 200
    assert q.peek("m") is keep


def test_a_retried_request_is_served_once_under_its_new_key() -> None:
    q = RequestQueues(make_ordering("priority_tiered"))
    first, second = _request(0), _request(1)
    q.push(first)
    q.push(second)
    entry = q.peek_entry("m")
    assert entry == ((0, 0), first)  # the ordering's key, as the ordering made it
    q.remove(first.key)
    q.push(first)  # same arrival, same key: its stale entry ties with the live one
    assert [q.pop("m") for _ in range(3)] == [first, second, None]
    assert len(q) == 0 and q.waiting_models() == []


def test_expiry_survives_a_compaction_halfway() -> None:
    q = RequestQueues(PriorityOrdering())
    requests = [_request(n, deadline=1.0 + n) for n in range(136)]
    for request in requests:
        q.push(request)
    for request in requests[36:]:  # 100 stale deadline entries, 36 live: one short of compacting
        q.remove(request.key)
    expired = q.pop_expired(1000.0)  # the first removal inside compacts the deadline heap
    assert [r.request_id for r in expired] == [f"r{n}" for n in range(36)]
    assert len(q) == 0 and q.next_deadline() is None


def test_out_of_order_arrivals_and_deadlines_keep_their_order() -> None:
    q = RequestQueues(PriorityOrdering())
    r0, r1, r2 = _request(0, deadline=2.0), _request(1, deadline=3.0), _request(2, deadline=2.0)
    for request in (r0, r1, r2):  # r2's deadline is earlier than r1's though it came later
        q.push(request)
    q.remove(r0.key)
    q.push(r0)  # a retry re-enters with the earliest arrival of all
    assert q.peek_oldest("m") is r0
    assert q.next_deadline() == 2.0
    # equal deadlines expire in the order they were queued: r2 before the re-queued r0
    assert [r.request_id for r in q.pop_expired(2.5)] == ["r2", "r0"]
    assert q.pop_oldest("m") is r1 and len(q) == 0


def test_of_model_lists_only_that_models_live_requests() -> None:
    q = RequestQueues(PriorityOrdering())
    for n in range(6):
        q.push(_request(n, model="m" if n % 2 else "other", priority=n))
    q.remove((1, "r3"))  # lazily removed: its heap entry stays until compaction
    assert sorted(r.request_id for r in q.of_model("m")) == ["r1", "r5"]
    assert sorted(r.request_id for r in q.of_model("other")) == ["r0", "r2", "r4"]
    assert q.of_model("none") == []
