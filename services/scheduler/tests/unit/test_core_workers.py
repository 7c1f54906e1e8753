"""Slots, retries, worker loss, cold starts and session loss in the core."""

from __future__ import annotations

from typing import TYPE_CHECKING

from loadmaster.scheduler.domain import Grant, LoadModel, Reject, SlotState
from loadmaster.v1 import errors_pb2

if TYPE_CHECKING:
    from conftest import Harness, MakeHarness

READY, LOADING, IDLE = SlotState.READY, SlotState.LOADING, SlotState.IDLE
UNAVAILABLE = errors_pb2.ERROR_CODE_UNAVAILABLE
INTERNAL = errors_pb2.ERROR_CODE_INTERNAL


def test_max_inflight_is_respected_per_worker(make_harness: MakeHarness) -> None:
    h = make_harness(max_inflight=lambda model_id: 2)
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("a", "b", "c", "d")
    assert h.granted_ids() == ["a", "b"]
    [stats] = h.core.queue_stats()
    assert (stats.depth, stats.inflight, stats.granted) == (2, 2, 2)
    h.complete("a")
    assert h.granted_ids() == ["a", "b", "c"]
    for request_id in ("b", "c"):
        h.complete(request_id)
    h.complete("d")
    h.check(settled=True)


def test_grants_go_to_the_least_busy_ready_worker(make_harness: MakeHarness) -> None:
    h = make_harness(max_inflight=lambda model_id: 2)
    h.worker("w1", ["m"], ready=["m"])
    h.worker("w2", ["m"], ready=["m"])
    h.worker("w3", ["m"])  # not READY: never granted
    h.enqueue("a", "b", "c", "d", "e")
    workers = [g.worker_id for g in h.grants()]
    assert sorted(workers) == ["w1", "w1", "w2", "w2"]
    assert workers[0] != workers[1]  # the second grant went to the idle worker
    h.complete("a")
    assert h.grants()[-1] == Grant(
        "e", workers[0], f"tcp://{workers[0]}:5556", 1, h.grants()[-1].deadline_unix_ns, 1
    )


def test_retryable_failure_is_granted_again_then_finally_rejected(h: Harness) -> None:
    h.worker("w1", ["m"], ready=["m"])
    h.worker("w2", ["m"], ready=["m"])
    h.enqueue("r")
    h.complete("r", error=UNAVAILABLE, retryable=True)
    assert [g.attempt for g in h.grants()] == [1, 2]
    h.complete("r", error=UNAVAILABLE, retryable=True)  # max_retries = 1: that was the last try
    [reject] = h.rejects()
    assert reject.error_code == UNAVAILABLE
    assert "after 2 attempts" in reject.message
    assert h.core.queue_stats()[0].inflight == 0
    h.check(settled=True)


def test_a_retried_request_keeps_its_age(h: Harness) -> None:
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("first")
    h.enqueue("second")
    h.complete("first", error=UNAVAILABLE, retryable=True)  # frees the slot, re-queues "first"
    assert h.granted_ids() == ["first", "first"]
    h.complete("first")
    assert h.granted_ids()[-1] == "second"
    h.complete("second")
    h.check(settled=True)


def test_non_retryable_failure_and_success_end_the_request(h: Harness) -> None:
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("ok", "bad")
    h.complete("ok")
    h.complete("bad", error=INTERNAL, retryable=False)
    assert h.rejects() == []
    assert h.granted_ids() == ["ok", "bad"]
    h.check(settled=True)


def test_a_retry_past_its_deadline_is_rejected_with_the_error(h: Harness) -> None:
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("r", timeout_ms=50)
    h.clock.advance(0.06)
    h.complete("r", error=UNAVAILABLE, retryable=True)
    [reject] = h.rejects()
    assert (reject.error_code, "after 1 attempt:" in reject.message) == (UNAVAILABLE, True)
    h.check(settled=True)


def test_a_late_complete_from_an_earlier_attempt_is_ignored(h: Harness) -> None:
    h.worker("w1", ["m"], ready=["m"])
    h.worker("w2", ["m"], ready=["m"])
    h.enqueue("r")
    first = h.grants()[0].worker_id
    h.lose_worker(first)
    second = h.grants()[-1]
    assert (second.attempt, second.worker_id != first) == (2, True)
    h.complete("r", worker=first)  # stale: must not free the new grant
    assert h.core.queue_stats()[0].inflight == 1
    h.complete("r")
    assert h.core.queue_stats()[0].inflight == 0
    h.check(settled=True)


def test_worker_loss_requeues_its_grants_to_another_worker(h: Harness) -> None:
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("r")
    h.worker("w2", ["m"], ready=["m"])
    h.lose_worker("w1")
    assert [(g.worker_id, g.attempt) for g in h.grants()] == [("w1", 1), ("w2", 2)]
    h.complete("r")
    assert [w.hello.worker_id for w in h.core.workers()] == ["w2"]
    h.check(settled=True)


def test_worker_loss_without_retries_left_rejects_unavailable(make_harness: MakeHarness) -> None:
    h = make_harness(max_retries=0)
    h.worker("w1", ["m"], ready=["m"])
    h.worker("w2", ["m"], ready=["m"])
    h.enqueue("r")
    h.lose_worker(h.grants()[0].worker_id)
    [reject] = h.rejects()
    assert reject.error_code == UNAVAILABLE
    assert "disconnected" in reject.message
    h.check(settled=True)


def test_worker_loss_commands_a_load_elsewhere_for_the_waiters(h: Harness) -> None:
    h.worker("w1", ["m"], ready=["m"])
    h.worker("w2", ["m"])
    h.enqueue("r", "waiting")
    h.lose_worker("w1")
    assert h.commands == [("w2", LoadModel("m"))]
    h.report("w2", {"m": READY})
    assert [(g.request_id, g.worker_id, g.attempt) for g in h.grants()[1:]] == [("r", "w2", 2)]
    h.complete("r")
    h.complete("waiting")
    h.check(settled=True)


def test_cold_model_load_is_commanded_once_on_the_least_loaded_worker(h: Harness) -> None:
    h.worker("busy", ["m", "a", "b"])
    h.report("busy", {"a": READY, "b": READY})
    h.worker("light", ["m", "a"])
    h.report("light", {"a": READY})
    h.enqueue("r1")
    h.enqueue("r2")
    h.report("busy", {"a": READY, "b": READY})  # reports that change nothing for "m"
    h.report("light", {"a": READY})
    assert h.commands == [("light", LoadModel("m"))]
    assert h.grants() == []
    h.report("light", {"a": READY, "m": LOADING})
    h.enqueue("r3")
    assert h.grants() == [] and len(h.commands) == 1  # LOADING is not READY
    h.report("light", {"a": READY, "m": READY})
    assert [(g.request_id, g.worker_id) for g in h.grants()] == [("r1", "light")]
    for request_id in ("r1", "r2", "r3"):
        h.complete(request_id)
    h.check(settled=True)


def test_a_load_failure_rejects_the_waiters_with_its_error(h: Harness) -> None:
    h.worker("w1", ["m"])
    h.enqueue("r1", "r2")
    h.report("w1", {"m": LOADING})
    h.report("w1", {"m": IDLE}, error="CUDA out of memory")
    rejects = h.rejects()
    assert [r.request_id for r in rejects] == ["r1", "r2"]
    assert all(r.error_code == UNAVAILABLE and "CUDA out of memory" in r.message for r in rejects)
    h.check(settled=True)
    # The next waiter commands a new load; a stale report of the old error is not a new failure.
    h.enqueue("r3")
    assert h.commands == [("w1", LoadModel("m")), ("w1", LoadModel("m"))]
    h.report("w1", {"m": IDLE}, error="CUDA out of memory")  # same generation: stale
    assert h.state("r3") == "queued"
    # The same failure again, LOADING coalesced away: the worker bumped the generation.
    h.report("w1", {"m": IDLE}, error="CUDA out of memory", gen=2)
    assert h.state("r3") == "done"
    assert "CUDA out of memory" in h.rejects()[-1].message
    h.check(settled=True)


def test_a_load_prefers_a_worker_where_it_did_not_just_fail(h: Harness) -> None:
    h.worker("a", ["m"])
    h.report("a", {"m": IDLE}, error="broken")
    h.worker("b", ["m", "x"])
    h.report("b", {"x": READY})
    h.enqueue("r")
    assert h.commands == [("b", LoadModel("m"))]


def test_a_gateway_session_loss_drops_its_waiters_and_frees_its_slots(h: Harness) -> None:
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("g1", "q1", session=1)
    h.enqueue("other", session=2)
    h.close_session(1)
    assert [(s, o.request_id) for s, o in h.outcomes if isinstance(o, Grant)] == [(1, "g1"), (2, "other")]
    assert h.rejects() == []
    h.complete("g1", session=1)  # late: ignored
    h.complete("other", session=2)
    assert h.core.queue_stats()[0].inflight == 0
    assert h.core.next_deadline() is None
    h.check(settled=True)


def test_a_reconnecting_worker_replaces_its_old_registration(h: Harness) -> None:
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("r")
    h.worker("w1", ["m"], ready=["m"])  # same id again: the old session's grants are retried
    assert [(g.worker_id, g.attempt) for g in h.grants()] == [("w1", 1), ("w1", 2)]
    assert len(h.core.workers()) == 1
    h.complete("r")
    h.check(settled=True)


def test_admin_views(h: Harness) -> None:
    h.worker("w2", ["m", "n"])
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("r1", "r2")
    views = h.core.workers()
    assert [v.hello.worker_id for v in views] == ["w1", "w2"]
    assert [(s.model_id, s.state) for s in views[0].slots] == [("m", READY)]
    [stats] = h.core.queue_stats()
    assert (stats.model_id, stats.depth, stats.inflight, stats.granted) == ("m", 1, 1, 1)
    assert h.core.strategy == "model_deadline"
    assert not any(isinstance(o, Reject) for o in h.take())
