"""Queue policy per model, conflation, clients, batching, strategy switches, starvation and fairness."""

from __future__ import annotations

import pytest

from loadmaster.common.ordering import BatchRule, make_ordering
from loadmaster.scheduler.config import ModelPolicy
from loadmaster.scheduler.domain import Grant, OverflowPolicy, Reject, RequestInfo, SlotState
from loadmaster.v1 import errors_pb2

from .conftest import Harness, MakeHarness

READY = SlotState.READY


def _info(rid: str, client: str, *, model: str = "m", priority: int = 0, **kw: object) -> RequestInfo:
    return RequestInfo(rid, model, client_id=client, priority=priority, **kw)  # type: ignore[arg-type]


def _rejects(h: Harness, code: int) -> list[str]:
    return [r.request_id for r in h.rejects() if r.error_code == code]


def test_latest_only_supersedes_queued_older(make_harness: MakeHarness) -> None:
    h = make_harness(
        model_policy=lambda m: ModelPolicy(100, 1000.0, OverflowPolicy.REJECT_NEWEST, latest_only=(m == "m"))
    )
    h.worker("w", ["m", "other"], ready=["m", "other"])
    h.enqueue_batch([_info("r1", "robot")])  # granted at once
    h.enqueue_batch([_info("r2", "robot")])  # queued behind r1
    h.enqueue_batch([_info("r3", "robot"), _info("x1", "someone-else")])
    assert _rejects(h, errors_pb2.ERROR_CODE_SUPERSEDED) == ["r2"]
    h.complete("r1")
    h.complete("r3")
    h.complete("x1")
    assert h.granted_ids() == ["r1", "r3", "x1"]  # r2 never ran
    # another model without latest_only keeps both
    h.enqueue_batch([_info("o1", "robot", model="other"), _info("o2", "robot", model="other")])
    assert _rejects(h, errors_pb2.ERROR_CODE_SUPERSEDED) == ["r2"]
    h.check()


def test_per_model_ttl_and_overflow_override(make_harness: MakeHarness) -> None:
    def policy(model_id: str) -> ModelPolicy:
        if model_id == "short":
            return ModelPolicy(1, 50.0, OverflowPolicy.DROP_OLDEST)
        return ModelPolicy(100, 1000.0, OverflowPolicy.REJECT_NEWEST)

    h = make_harness(model_policy=policy)
    h.worker("w", ["m", "short"])  # nothing READY: everything waits
    h.enqueue("s1", "s2", model="short")
    h.enqueue("m1", "m2", model="m")
    assert _rejects(h, errors_pb2.ERROR_CODE_OVERFLOW) == ["s1"]  # short keeps 1, drops the oldest
    h.advance(0.05)
    assert _rejects(h, errors_pb2.ERROR_CODE_EXPIRED) == ["s2"]  # 50 ms TTL, not the global 1000
    h.advance(0.95)
    assert sorted(_rejects(h, errors_pb2.ERROR_CODE_EXPIRED)) == ["m1", "m2", "s2"]
    h.check(settled=True)


def test_silent_client_disconnects_once_and_loses_queued(make_harness: MakeHarness) -> None:
    h = make_harness(disconnect_timeout_s=2.0, request_ttl_ms=60_000.0)
    h.worker("w", ["m"], ready=["m"])
    h.enqueue_batch([_info("a1", "alice"), _info("a2", "alice"), _info("b1", "bob")])
    assert h.core.active_clients == 2
    assert h.core.next_deadline() == h.clock.monotonic() + 2.0
    h.advance(1.0)
    h.enqueue_batch([_info("b2", "bob")])  # bob stays alive
    h.advance(1.0)  # alice silent for 2 s
    assert h.core.active_clients == 1
    dropped = _rejects(h, errors_pb2.ERROR_CODE_CANCELLED)
    assert dropped == ["a2"]  # a1 was granted (it runs), a2 was queued
    assert "disconnected" in h.rejects()[0].message
    h.advance(0.5)
    h.advance(10.0)  # bob goes silent too; alice is not reported again
    assert h.core.active_clients == 0
    assert _rejects(h, errors_pb2.ERROR_CODE_CANCELLED) == ["a2", "b1", "b2"]
    assert h.core.next_deadline() is None  # nothing waiting, nobody active: no timer at all
    h.enqueue_batch([_info("a3", "alice")])  # she comes back
    assert h.core.active_clients == 1
    h.check()


@pytest.mark.parametrize("client_type", ["openai", "kserve"])
def test_a_waiting_connection_bound_client_is_not_silent(make_harness: MakeHarness, client_type: str) -> None:
    """The OpenAI, KServe HTTP and gRPC front ends watch their clients' connections: a request
    that waits long in the queue (a cold load, the VRAM gate) is not dropped for silence."""
    h = make_harness(disconnect_timeout_s=2.0, request_ttl_ms=60_000.0)
    h.worker("w", ["m"], ready=["m"])
    bound = {"client_type": client_type, "connection_bound": True}
    h.enqueue_batch([_info("c1", "chat", **bound), _info("c2", "chat", **bound)])
    h.advance(5.0)
    assert _rejects(h, errors_pb2.ERROR_CODE_CANCELLED) == [] and h.core.active_clients == 0
    h.complete("c1")
    assert h.granted_ids() == ["c1", "c2"]
    h.check()


def test_batch_released_on_size_or_timer(make_harness: MakeHarness) -> None:
    h = make_harness(max_inflight=lambda m: 4)
    h.core.set_ordering(make_ordering("batch_optimized", batch=BatchRule(max_batch_size=3, max_wait_s=0.01)))
    h.worker("w1", ["m"], ready=["m"])
    h.worker("w2", ["m"], ready=["m"])
    h.enqueue("r1", "r2")
    assert h.grants() == []  # held: 2 < 3 and 0 ms waited
    assert h.core.next_deadline() == h.clock.monotonic() + 0.01  # the release time, not the 1 s TTL
    h.enqueue("r3")  # full: released together, to one worker
    grants = h.grants()
    assert [g.request_id for g in grants] == ["r1", "r2", "r3"] and len({g.worker_id for g in grants}) == 1
    h.enqueue("r4")
    h.clock.advance(0.009)
    h.core.expire_due()
    assert len(h.grants()) == 3
    h.clock.advance(0.001)
    h.core.expire_due()  # the timer: r4 waited max_wait
    assert h.granted_ids()[-1] == "r4"
    h.check()


def test_switch_moves_every_waiting_request(h: Harness) -> None:
    h.worker("w", ["m", "n"])  # nothing ready: all wait
    h.enqueue_batch([_info(f"r{i}", f"c{i % 3}", priority=i % 3) for i in range(30)])
    h.enqueue_batch([_info(f"n{i}", "c0", model="n") for i in range(5)])
    for name in ("deadline_aware", "round_robin", "batch_optimized", "priority_tiered", "tiered_deadline"):
        assert h.core.set_ordering(make_ordering(name)) == 35
        assert h.core.strategy == name
    h.report("w", {"m": READY, "n": READY})
    done = 0
    while grants := [g for g in h.take() if isinstance(g, Grant)]:
        for g in grants:
            h.complete(g.request_id)
            done += 1
    assert done == 35
    h.check(settled=True)


def test_starvation_bound_under_steady_priority0_load(make_harness: MakeHarness) -> None:
    """Priority 2 waits behind a saturating priority-0 stream, but not past the aging bound
    (2 x priority_step_ms 100 ms + the budget difference)."""
    h = make_harness(request_ttl_ms=10_000.0)
    h.worker("w", ["m"], ready=["m"])
    h.enqueue_batch([_info("busy", "p0-x")])
    h.enqueue_batch([_info("low", "p2", priority=2)])
    waited = None
    for i in range(200):  # a new priority-0 request every 10 ms = the service time: always one waiting
        h.clock.advance(0.01)
        h.enqueue_batch([_info(f"hi{i}", f"p0-{i % 4}")])
        h.complete(h.grants()[-1].request_id)
        if h.grants()[-1].request_id == "low":
            waited = (i + 1) * 0.01
            break
    assert waited is not None, "priority 2 starved"
    assert 0.1 < waited <= 0.2 + 0.05 + 0.01  # it waited behind priority 0, within the bound


def test_fair_share_within_a_priority_level(h: Harness) -> None:
    h.worker("w", ["m"], ready=["m"])
    h.enqueue_batch([_info("first", "x")])  # occupies the one slot
    h.enqueue_batch([_info(f"f{i}", "flood") for i in range(10)])
    h.enqueue_batch([_info(f"s{i}", "steady") for i in range(3)])
    for _ in range(13):
        h.complete(h.grants()[-1].request_id)
    served = h.granted_ids()[1:]
    # FIFO would put steady at positions 10..12; fair share interleaves it with the flood
    assert max(served.index(f"s{i}") for i in range(3)) <= 7, served
    h.check()


def test_cadence_from_arrivals_moves_a_fast_client_ahead(h: Harness) -> None:
    h.worker("w", ["m"], ready=["m"])
    h.enqueue_batch([_info("block", "x")])
    for _ in range(3):  # fast: every 10 ms (cadence 10 ms < its 50 ms budget)
        h.enqueue_batch([_info(f"fast{_}", "fast")])
        h.complete(h.grants()[-1].request_id)
        h.clock.advance(0.01)
    h.enqueue_batch([_info("slow", "slow")])  # first sight of it: no cadence yet
    h.enqueue_batch([_info("fast-last", "fast")])
    h.complete(h.grants()[-1].request_id)
    assert h.granted_ids()[-1] == "fast-last"


def test_reject_answers_are_rejects(h: Harness) -> None:
    h.worker("w", ["m"])
    h.enqueue_batch([_info("r", "c", timeout_ms=10.0)])
    h.advance(0.01)
    assert [type(o) for o in h.take()] == [Reject]


def test_latest_only_in_one_batch_runs_the_older_when_a_worker_is_free(make_harness: MakeHarness) -> None:
    h = make_harness(
        model_policy=lambda m: ModelPolicy(100, 1000.0, OverflowPolicy.REJECT_NEWEST, latest_only=True)
    )
    h.worker("w1", ["m"], ready=["m"])
    h.worker("w2", ["m"], ready=["m"])
    h.enqueue_batch([_info("r1", "robot"), _info("r2", "robot"), _info("r3", "robot"), _info("r4", "robot")])
    assert h.granted_ids() == ["r1", "r2"]  # one per free worker, as if they came one by one
    assert _rejects(h, errors_pb2.ERROR_CODE_SUPERSEDED) == ["r3"]  # r4 waits, r3 gave way
    h.check()


def test_a_due_batch_a_worker_has_room_for_keeps_the_timer_armed(make_harness: MakeHarness) -> None:
    """The dispatch that found a group not yet due may have read the clock just before its
    release (timers fire up to 1 ms early): the next wake-up must still release it."""
    h = make_harness(max_inflight=lambda m: 1)
    h.core.set_ordering(make_ordering("batch_optimized", batch=BatchRule(max_batch_size=3, max_wait_s=0.01)))
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("r1")
    release = h.clock.monotonic() + 0.01
    h.clock.advance(0.0105)  # due, but no dispatch has looked since
    assert h.core.next_deadline() == release  # in the past: the timer fires at once
    h.core.expire_due()
    assert h.granted_ids() == ["r1"]
    h.enqueue("r2")
    h.clock.advance(0.0105)  # due again, but w1's only slot is busy: no wake-up loop
    assert h.core.next_deadline() > h.clock.monotonic()  # r2's TTL, or a client check
    h.complete("r1")  # the completion releases it
    assert h.granted_ids() == ["r1", "r2"]
    h.complete("r2")
    h.check(settled=True)
