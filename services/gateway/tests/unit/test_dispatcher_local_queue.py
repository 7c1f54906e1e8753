"""The dispatcher's local queue: while its credits carry a `LocalQueue` spec (the gateway holds
the model's whole share), calls that find no idle credit wait in the gateway, not at the
scheduler (docs/data-path.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from loadmaster.common.clock import FakeClock, SystemClock
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.gateway.calls import CallResult, InferenceCall
from loadmaster.gateway.dispatcher import Dispatcher
from loadmaster.gateway.held_credits import OLD_SHARE_GRACE_S
from loadmaster.v1 import errors_pb2, model_pool_pb2, scheduler_pb2


class _SchedulerDouble:
    """The scheduler session as the dispatcher sees it: records what it is told, in order."""

    def __init__(self) -> None:
        self.connected = True
        self.session = 1
        self.enqueued: list[scheduler_pb2.RequestInfo] = []
        self.cancelled: list[str] = []
        self.returned: list[str] = []
        self.order: list[str] = []
        self.depths: list[int] = []  # local depths reported, in order
        self.outstanding_s = 0.0  # the demand reported (call-seconds), summed

    def enqueue(self, request: scheduler_pb2.RequestInfo) -> None:
        self.enqueued.append(request)
        self.order.append(f"enqueue {request.request_id}")

    def report_run(self, request_id: str, model_id: str, info: Any) -> None:
        request = info()
        self.enqueued.append(request)
        self.order.append(f"run {request.request_id}")

    def complete(self, request_id: str, **_: Any) -> None:
        self.order.append(f"complete {request_id}")

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def return_credit(self, credit_id: str) -> None:
        self.returned.append(credit_id)
        self.order.append(f"return {credit_id}")

    def report_local_depth(self, model_id: str, waiting: int, outstanding_s: float = 0.0) -> None:
        self.depths.append(waiting)
        self.outstanding_s += outstanding_s


class _WorkersDouble:
    def __init__(self) -> None:
        self.sent: list[tuple[str, model_pool_pb2.InferRequest]] = []

    def send(self, endpoint: str, envelope: bytes, payload: Any) -> None:
        self.sent.append((endpoint, model_pool_pb2.InferRequest.FromString(envelope)))


Parts = tuple[Dispatcher, _SchedulerDouble, _WorkersDouble, list[CallResult]]


def _dispatcher(clock: FakeClock | SystemClock) -> tuple[Dispatcher, _SchedulerDouble, _WorkersDouble]:
    scheduler, workers = _SchedulerDouble(), _WorkersDouble()
    dispatcher = Dispatcher(
        scheduler=lambda _: scheduler,
        workers=lambda _: workers,
        telemetry=TelemetryReporter("gateway", "test", None),
        clock=clock,
    )
    return dispatcher, scheduler, workers


@pytest.fixture()
async def parts() -> AsyncIterator[Parts]:
    dispatcher, scheduler, workers = _dispatcher(FakeClock())
    dispatcher.start()
    results: list[CallResult] = []
    yield dispatcher, scheduler, workers, results
    await dispatcher.close()


def _spec(**fields: object) -> scheduler_pb2.LocalQueue:
    values: dict[str, object] = {
        "strategy": "priority",
        "priority_step_ms": 100.0,
        "urgency_weight": 0.5,
        "steps_horizon": 8,
        "service_ms": 10.0,
        "latency_budget_ms": 50.0,
        "cadence_alpha": 0.3,
        "max_queue_size": 100,
    }
    values.update(fields)
    return scheduler_pb2.LocalQueue(**values)  # type: ignore[arg-type]


def _credit(
    credit_id: str, spec: scheduler_pb2.LocalQueue | None = None, ttl_ms: float = 500.0
) -> scheduler_pb2.Credit:
    credit = scheduler_pb2.Credit(
        credit_id=credit_id,
        model_id="double",
        worker_id="w1",
        data_endpoint="tcp://w1",
        generation=3,
        request_ttl_ms=ttl_ms,
    )
    credit.local_queue.CopyFrom(spec if spec is not None else _spec())
    return credit


def _call(request_id: str, *, client: str = "c", priority: int = 1, timeout_ms: float = 0.0) -> InferenceCall:
    return InferenceCall(
        request_id=request_id,
        client_id=client,
        model_id="double",
        inputs=[],
        payload=b"x",
        priority=priority,
        timeout_ms=timeout_ms,
    )


def _ok(request_id: str, queue_ms: float = 0.0) -> model_pool_pb2.InferResponse:
    """A success that took 10 ms to run (what every call of the model takes here: steady),
    after `queue_ms` waiting at its worker."""
    return model_pool_pb2.InferResponse(
        request_id=request_id,
        model_id="double",
        worker_id="w1",
        inference_latency_ms=10.0,
        queue_ms=queue_ms,
    )


def _sent(workers: _WorkersDouble) -> list[str]:
    return [request.request_id for _, request in workers.sent]


async def test_calls_beyond_the_credits_wait_in_the_gateway_and_take_the_next_free_credit(
    parts: Parts,
) -> None:
    dispatcher, scheduler, workers, results = parts
    dispatcher.on_credit(_credit("c1"))
    for request_id in ("r1", "r2", "r3"):
        dispatcher.submit(_call(request_id), results.append)
    assert _sent(workers) == ["r1"]
    assert scheduler.order == ["run r1"]  # r2 and r3 never reach the scheduler while they wait
    assert scheduler.depths == [1, 2]  # ...which only hears how many wait here
    dispatcher.on_worker_reply(_ok("r1"), b"")
    assert _sent(workers) == ["r1", "r2"]
    assert scheduler.order == ["run r1", "complete r1", "run r2"]
    dispatcher.on_worker_reply(_ok("r2"), b"")
    dispatcher.on_worker_reply(_ok("r3"), b"")
    assert [r.request_id for r in results] == ["r1", "r2", "r3"] and all(r.ok for r in results)
    assert [e.credit_id for e in scheduler.enqueued] == ["c1", "c1", "c1"]
    assert dispatcher.inflight == 0


async def test_the_demand_reported_is_the_integral_of_the_calls_waiting_or_running(parts: Parts) -> None:
    """The scheduler splits a model between gateways by it (docs/data-path.md)."""
    dispatcher, scheduler, _workers, _results = parts
    clock = dispatcher._clock
    assert isinstance(clock, FakeClock)
    dispatcher.on_credit(_credit("c1"))
    for request_id in ("r1", "r2", "r3"):
        dispatcher.submit(_call(request_id), _results.append)
    clock.advance(0.2)  # 3 calls for 0.2 s (one running, two waiting)
    dispatcher.on_worker_reply(_ok("r1"), b"")
    clock.advance(0.1)  # 2 calls for 0.1 s
    dispatcher.on_worker_reply(_ok("r2"), b"")
    clock.advance(0.1)  # 1 call for 0.1 s
    dispatcher.on_worker_reply(_ok("r3"), b"")
    assert scheduler.outstanding_s < 0.85  # the last part is reported with the next demand report
    for _ in range(20):  # the watchdog's turn (every 0.25 s) reports it; bounded
        clock.advance(0.05)
        await asyncio.sleep(0)
    assert scheduler.outstanding_s == pytest.approx(3 * 0.2 + 2 * 0.1 + 1 * 0.1)


async def test_the_local_queue_ranks_by_the_scheduler_strategy(parts: Parts) -> None:
    dispatcher, _scheduler, workers, results = parts
    dispatcher.on_credit(_credit("c1"))
    dispatcher.submit(_call("busy"), results.append)
    dispatcher.submit(_call("low", client="a", priority=2), results.append)
    dispatcher.submit(_call("high", client="b", priority=0), results.append)
    dispatcher.submit(_call("mid", client="c", priority=1), results.append)
    for request_id in ("busy", "high", "mid"):
        dispatcher.on_worker_reply(_ok(request_id), b"")
    assert _sent(workers) == ["busy", "high", "mid", "low"]


async def test_a_new_credit_starts_a_waiting_call(parts: Parts) -> None:
    dispatcher, _scheduler, workers, results = parts
    dispatcher.on_credit(_credit("c1"))
    dispatcher.submit(_call("r1"), results.append)
    dispatcher.submit(_call("r2"), results.append)
    dispatcher.on_credit(_credit("c2"))
    assert _sent(workers) == ["r1", "r2"]


async def test_revoking_the_last_credit_hands_the_waiting_calls_to_the_scheduler_in_order(
    parts: Parts,
) -> None:
    dispatcher, scheduler, workers, results = parts
    dispatcher.on_credit(_credit("c1"))
    dispatcher.submit(_call("r1"), results.append)
    dispatcher.submit(_call("low", priority=2), results.append)
    dispatcher.submit(_call("high", priority=0), results.append)
    dispatcher.on_revoke("c1")
    assert scheduler.order == ["run r1", "enqueue high", "enqueue low"]
    dispatcher.submit(_call("later"), results.append)  # no share any more: straight to the scheduler
    assert scheduler.order[-1] == "enqueue later"
    dispatcher.on_worker_reply(_ok("r1"), b"")
    assert scheduler.returned == ["c1"] and _sent(workers) == ["r1"]


async def test_a_credit_without_a_spec_stops_local_queueing_but_serves_those_waiting(parts: Parts) -> None:
    dispatcher, scheduler, workers, results = parts
    dispatcher.on_credit(_credit("c1"))
    dispatcher.submit(_call("r1"), results.append)
    dispatcher.submit(_call("r2"), results.append)
    plain = _credit("c2")
    plain.ClearField("local_queue")
    dispatcher.on_credit(plain)  # starts r2
    dispatcher.submit(_call("r3"), results.append)  # both busy, no local queue now
    assert _sent(workers) == ["r1", "r2"]
    assert scheduler.order[-1] == "enqueue r3"


async def test_a_cancelled_waiting_call_is_never_sent_nor_reported(parts: Parts) -> None:
    dispatcher, scheduler, workers, results = parts
    dispatcher.on_credit(_credit("c1"))
    dispatcher.submit(_call("r1"), results.append)
    dispatcher.submit(_call("r2"), results.append)
    dispatcher.cancel("r2")
    assert scheduler.depths == [1, 0]
    dispatcher.on_worker_reply(_ok("r1"), b"")
    assert _sent(workers) == ["r1"] and scheduler.cancelled == []
    assert [r.request_id for r in results] == ["r1"] and dispatcher.inflight == 0


async def test_a_full_local_queue_refuses_the_newest_or_drops_the_oldest(parts: Parts) -> None:
    dispatcher, _scheduler, _workers, results = parts
    dispatcher.on_credit(_credit("c1", _spec(max_queue_size=2, reject_newest=True)))
    for request_id in ("r1", "w1", "w2", "w3"):
        dispatcher.submit(_call(request_id), results.append)
    [refused] = results
    assert refused.request_id == "w3" and refused.error is not None
    assert (
        refused.error.code == errors_pb2.ERROR_CODE_OVERFLOW and "full (2 waiting)" in refused.error.message
    )

    dispatcher2, _s, _w = _dispatcher(FakeClock())
    dropped: list[CallResult] = []
    dispatcher2.on_credit(_credit("c1", _spec(max_queue_size=2)))
    for request_id in ("r1", "w1", "w2", "w3"):
        dispatcher2.submit(_call(request_id), dropped.append)
    [oldest] = dropped
    assert oldest.request_id == "w1" and oldest.error is not None
    assert "dropped the oldest" in oldest.error.message


async def test_a_waiting_call_expires_on_time_with_the_scheduler_message() -> None:
    dispatcher, scheduler, workers = _dispatcher(SystemClock())
    done: dict[str, float] = {}
    results: list[CallResult] = []

    def record(result: CallResult) -> None:
        done[result.request_id] = time.monotonic()
        results.append(result)

    dispatcher.on_credit(_credit("c1", ttl_ms=5000.0))
    dispatcher.submit(_call("r1"), record)
    started = time.monotonic()
    dispatcher.submit(_call("r2", timeout_ms=50.0), record)  # its own, shorter timeout
    for _ in range(100):  # bounded: 1 s at most
        if "r2" in done:
            break
        await asyncio.sleep(0.01)
    [expired] = results
    assert expired.error is not None and expired.error.code == errors_pb2.ERROR_CODE_EXPIRED
    assert "expired after waiting" in expired.error.message and "'double'" in expired.error.message
    assert 0.05 <= done["r2"] - started < 0.5
    assert _sent(workers) == ["r1"] and scheduler.order == ["run r1"]
    dispatcher.on_worker_reply(_ok("r1"), b"")
    assert _sent(workers) == ["r1"]  # the expired call is not sent afterwards


async def test_losing_the_scheduler_keeps_the_waiting_calls_on_the_credits_left(parts: Parts) -> None:
    dispatcher, scheduler, workers, results = parts
    dispatcher.on_credit(_credit("c1"))
    dispatcher.submit(_call("r1"), results.append)
    dispatcher.submit(_call("r2"), results.append)
    scheduler.connected = False
    dispatcher.on_scheduler_lost()
    dispatcher.submit(_call("r3"), results.append)  # queued on the lost scheduler's share
    assert results == []
    dispatcher.on_worker_reply(_ok("r1"), b"")
    dispatcher.on_worker_reply(_ok("r2"), b"")
    dispatcher.on_worker_reply(_ok("r3"), b"")
    assert [r.request_id for r in results] == ["r1", "r2", "r3"] and all(r.ok for r in results)
    assert _sent(workers) == ["r1", "r2", "r3"]


async def test_a_call_the_scheduler_hands_back_queues_on_the_share(parts: Parts) -> None:
    """Sent to the scheduler just before the credits arrived: it comes back with use_share."""
    dispatcher, scheduler, workers, results = parts
    dispatcher.submit(_call("early"), results.append)  # no credit yet: to the scheduler
    assert scheduler.order == ["enqueue early"]
    dispatcher.on_credit(_credit("c1"))
    dispatcher.submit(_call("r1"), results.append)  # takes the credit
    dispatcher.on_reject(scheduler_pb2.Reject(request_id="early", use_share=True))
    assert results == [] and _sent(workers) == ["r1"]  # not answered: waiting here now
    dispatcher.on_worker_reply(_ok("r1"), b"")
    assert _sent(workers) == ["r1", "early"]
    dispatcher.on_worker_reply(_ok("early"), b"")
    assert [r.request_id for r in results] == ["r1", "early"] and all(r.ok for r in results)


async def test_a_call_handed_back_again_and_again_is_answered_not_looped(parts: Parts) -> None:
    """A scheduler that counts a share this gateway does not hold hands the call back each time it
    is sent: after a few rounds it is answered `unavailable` instead of bouncing forever."""
    dispatcher, scheduler, _workers, results = parts
    dispatcher.submit(_call("r1"), results.append)  # no credit: to the scheduler
    for _ in range(10):  # bounded: answered after 3 hand-backs
        if results:
            break
        dispatcher.on_reject(
            scheduler_pb2.Reject(
                request_id="r1", use_share=True, error_code=errors_pb2.ERROR_CODE_UNAVAILABLE
            )
        )
    assert scheduler.order == ["enqueue r1"] * 4
    assert [(r.request_id, r.error.edge_code) for r in results if r.error] == [("r1", "unavailable")]
    assert "disagree" in str(results[0].error)


async def test_an_earlier_sessions_credit_does_not_keep_calls_waiting_here(parts: Parts) -> None:
    """After a scheduler restart the new session's credits are revoked (its worker died): a
    credit the lost session lent is no longer usable, so waiting calls go to the new scheduler."""
    dispatcher, scheduler, workers, results = parts
    dispatcher.on_credit(_credit("old"))
    dispatcher.submit(_call("r1"), results.append)  # runs on the old session's credit
    scheduler.session = 2  # the scheduler was restarted: a new session
    dispatcher.on_scheduler_lost()
    dispatcher.on_credit(_credit("new"))  # the new scheduler lends (and so serves)
    dispatcher.submit(_call("r2"), results.append)  # on the new credit
    dispatcher.submit(_call("r3"), results.append)  # waits here
    assert scheduler.order[-1] == "run r2"
    dispatcher.on_revoke("new")  # the new credit's worker died
    assert scheduler.order[-1] == "enqueue r3"  # not held for the old session's credit
    dispatcher.submit(_call("r4"), results.append)
    assert scheduler.order[-1] == "enqueue r4"
    assert _sent(workers) == ["r1", "r2"]


async def test_a_lost_sessions_share_serves_a_bounded_time_after_a_new_session_opens() -> None:
    """Served on old credits with a local queue, the gateway sends the new scheduler nothing to
    grant; without a bound it would serve on them (and their worker, maybe dead) for ever."""
    clock = FakeClock()
    dispatcher, scheduler, workers = _dispatcher(clock)
    results: list[CallResult] = []
    dispatcher.on_credit(_credit("old"))
    scheduler.session = 2  # a new scheduler: it has lent and granted nothing yet
    dispatcher.on_scheduler_lost()
    dispatcher.submit(_call("r1"), results.append)  # still on the lost session's share
    dispatcher.on_worker_reply(_ok("r1"), b"")
    assert _sent(workers) == ["r1"] and not [o for o in scheduler.order if o.startswith(("enqueue", "run"))]
    clock.advance(OLD_SHARE_GRACE_S + 0.1)
    dispatcher.submit(_call("r2"), results.append)  # the grace is over: to the new scheduler
    assert _sent(workers) == ["r1"] and scheduler.order[-1] == "enqueue r2"


# -- staged calls (LocalQueue.stage) and urgent ones sent to the front ---------------------


def _fronts(workers: _WorkersDouble) -> list[str]:
    return [request.request_id for _, request in workers.sent if request.front_of_queue]


def _staging(parts: Parts, *samples_ms: float) -> None:
    """One credit whose spec stages a call; the model's inference time measured by `samples_ms`
    (default: four calls of 10 ms, steady) through calls that leave no trace in `workers.sent`."""
    dispatcher, _scheduler, workers, results = parts
    dispatcher.on_credit(_credit("c1", _spec(stage=1)))
    for i, ms in enumerate(samples_ms or (10.0,) * 4):
        dispatcher.submit(_call(f"warm{i}", client="warm"), results.append)
        dispatcher.on_worker_reply(
            model_pool_pb2.InferResponse(
                request_id=f"warm{i}", model_id="double", worker_id="w1", inference_latency_ms=ms
            ),
            b"",
        )
    workers.sent.clear()
    results.clear()


async def test_an_unmeasured_or_unsteady_model_stages_nothing(parts: Parts) -> None:
    """Behind a call that may take 1 ms or 1.5 s a staged call could wait while another slot
    frees: a model's calls are staged only once its inference time is measured steady."""
    dispatcher, _scheduler, workers, results = parts
    dispatcher.on_credit(_credit("c1", _spec(stage=1)))
    dispatcher.submit(_call("r1"), results.append)
    dispatcher.submit(_call("r2"), results.append)
    assert _sent(workers) == ["r1"]  # unmeasured: r2 waits here
    dispatcher.on_worker_reply(
        model_pool_pb2.InferResponse(
            request_id="r1", model_id="double", worker_id="w1", inference_latency_ms=1500
        ),
        b"",
    )
    for request_id, ms in (("r2", 1.0), ("r3", 1500.0), ("r4", 1.0)):
        if request_id != "r2":
            dispatcher.submit(_call(request_id), results.append)
        dispatcher.submit(_call(request_id + "b"), results.append)
        assert _sent(workers)[-1] == request_id  # each runs alone: nothing staged behind it
        reply = model_pool_pb2.InferResponse(
            request_id=request_id, model_id="double", worker_id="w1", inference_latency_ms=ms
        )
        dispatcher.on_worker_reply(reply, b"")
        dispatcher.on_worker_reply(_ok(request_id + "b"), b"")


async def test_a_busy_credit_takes_one_staged_call_so_its_worker_never_waits_for_the_next(
    parts: Parts,
) -> None:
    dispatcher, scheduler, workers, results = parts
    _staging(parts)
    scheduler.order.clear()
    for request_id in ("r1", "r2", "r3"):
        dispatcher.submit(_call(request_id), results.append)
    assert _sent(workers) == ["r1", "r2"]  # r2 waits at the worker behind r1; r3 here
    assert scheduler.order == ["run r1", "run r2"]
    dispatcher.on_worker_reply(_ok("r1"), b"")  # r2 runs now: r3 is staged behind it
    assert _sent(workers) == ["r1", "r2", "r3"] and _fronts(workers) == []
    dispatcher.on_worker_reply(_ok("r2"), b"")
    dispatcher.on_worker_reply(_ok("r3"), b"")
    assert [r.request_id for r in results] == ["r1", "r2", "r3"] and all(r.ok for r in results)
    assert dispatcher.shares() == {"double": {"credits": 1, "waiting": 0}}
    dispatcher.submit(_call("r4"), results.append)  # the credit is idle again: runs at once
    assert _sent(workers)[-1] == "r4"


async def test_a_call_more_urgent_than_a_staged_one_goes_to_the_front_at_most_two_at_a_time(
    parts: Parts,
) -> None:
    dispatcher, _scheduler, workers, results = parts
    _staging(parts)
    dispatcher.submit(_call("running", client="a", priority=2), results.append)
    dispatcher.submit(_call("staged", client="b", priority=2), results.append)
    dispatcher.submit(_call("low", client="c", priority=2), results.append)  # waits here
    dispatcher.submit(_call("urgent1", client="d", priority=0), results.append)
    dispatcher.submit(_call("urgent2", client="e", priority=0), results.append)
    dispatcher.submit(_call("urgent3", client="f", priority=0), results.append)  # two fronts out: waits
    assert _sent(workers) == ["running", "staged", "urgent1", "urgent2"]
    assert _fronts(workers) == ["urgent1", "urgent2"]
    assert dispatcher.shares()["double"]["waiting"] == 2
    dispatcher.on_worker_reply(_ok("running"), b"")  # urgent1 runs: one front waits, one may go
    assert _sent(workers)[4:] == ["urgent3"] and _fronts(workers)[-1] == "urgent3"
    dispatcher.on_worker_reply(_ok("urgent1"), b"")
    assert _sent(workers)[5:] == []  # "low" is no more urgent than the staged call
    for request_id in ("urgent2", "urgent3", "staged"):
        dispatcher.on_worker_reply(_ok(request_id), b"")
    assert _sent(workers)[-1] == "low"
    dispatcher.on_worker_reply(_ok("low"), b"")
    assert sorted(r.request_id for r in results if r.ok) == sorted(
        ["running", "staged", "low", "urgent1", "urgent2", "urgent3"]
    )


async def test_a_call_no_more_urgent_than_the_staged_one_waits_here(parts: Parts) -> None:
    dispatcher, _scheduler, workers, results = parts
    _staging(parts)
    dispatcher.submit(_call("running", client="a", priority=0), results.append)
    dispatcher.submit(_call("staged", client="b", priority=0), results.append)
    dispatcher.submit(_call("later", client="c", priority=0), results.append)
    assert _sent(workers) == ["running", "staged"] and _fronts(workers) == []


async def test_a_revoked_credit_with_a_staged_call_is_returned_when_its_last_call_ends(
    parts: Parts,
) -> None:
    dispatcher, scheduler, _workers, results = parts
    _staging(parts)
    dispatcher.submit(_call("r1"), results.append)
    dispatcher.submit(_call("r2"), results.append)
    dispatcher.on_revoke("c1")
    dispatcher.on_worker_reply(_ok("r1"), b"")
    assert scheduler.returned == []  # r2 still runs on it
    dispatcher.on_worker_reply(_ok("r2"), b"")
    assert scheduler.returned == ["c1"] and [r.request_id for r in results] == ["r1", "r2"]


async def test_a_credit_whose_worker_failed_a_call_takes_no_more_and_goes_back_once_empty(
    parts: Parts,
) -> None:
    dispatcher, scheduler, workers, results = parts
    _staging(parts)
    for request_id in ("r1", "r2", "r3"):
        dispatcher.submit(_call(request_id), results.append)
    failure = model_pool_pb2.InferResponse(
        request_id="r1", worker_id="w1", error_code=errors_pb2.ERROR_CODE_UNAVAILABLE, retryable=True
    )
    dispatcher.on_worker_reply(failure, b"")
    assert _sent(workers) == ["r1", "r2"] and scheduler.returned == []  # nothing staged behind r2
    dispatcher.on_worker_reply(_ok("r2"), b"")
    assert scheduler.returned == ["c1"]
    assert scheduler.order[-2:] == ["return c1", "enqueue r3"]  # the share is gone: r3 goes central


async def test_a_slot_is_kept_free_for_two_urgent_clients_due_together(parts: Parts) -> None:
    """Two priority-0 clients send every 40 ms at the same moment (25 ms budget, 10 ms calls):
    a priority-2 call started just before them would make the second late, so the slot waits
    for them; once they have come, the priority-2 call runs."""
    dispatcher, _scheduler, workers, results = parts
    clock = dispatcher._clock
    assert isinstance(clock, FakeClock)
    dispatcher.on_credit(_credit("c1", _spec(stage=1, latency_budget_ms=25.0)))

    def reply(request_id: str, queue_ms: float = 0.0) -> None:
        dispatcher.on_worker_reply(_ok(request_id, queue_ms), b"")

    for tick in range(5):  # their cadence (and the model's 10 ms) is learnt; nothing else waits
        for client in ("a", "b"):
            dispatcher.submit(_call(f"{client}{tick}", client=client, priority=0), results.append)
        clock.advance(0.010)
        reply(f"a{tick}")
        clock.advance(0.010)
        reply(f"b{tick}", queue_ms=10.0)  # it waited behind a's
        clock.advance(0.020)
    clock.advance(-0.002)  # both are due in 2 ms
    workers.sent.clear()
    dispatcher.submit(_call("low", client="c", priority=2), results.append)
    assert _sent(workers) == []  # held
    clock.advance(0.002)
    dispatcher.submit(_call("a5", client="a", priority=0), results.append)
    dispatcher.submit(_call("b5", client="b", priority=0), results.append)
    assert _sent(workers)[0] == "a5" and "low" not in _sent(workers)[:2]


@pytest.mark.parametrize(("late_s", "held"), [(0.001, True), (0.030, False)], ids=["a-little", "long"])
async def test_a_slot_is_still_kept_free_for_urgent_clients_a_little_late(
    parts: Parts, late_s: float, held: bool
) -> None:
    """The urgent clients' next calls are `late_s` overdue: a little late (within twice the
    deviation of their gaps, about 17 ms after these five), the slot is still kept for them;
    long late, they are not waited for."""
    dispatcher, _scheduler, workers, results = parts
    clock = dispatcher._clock
    assert isinstance(clock, FakeClock)
    dispatcher.on_credit(_credit("c1", _spec(stage=1, latency_budget_ms=30.0)))
    for tick in range(5):
        for client in ("a", "b"):
            dispatcher.submit(_call(f"{client}{tick}", client=client, priority=0), results.append)
        clock.advance(0.010)
        dispatcher.on_worker_reply(_ok(f"a{tick}"), b"")
        clock.advance(0.010)
        dispatcher.on_worker_reply(_ok(f"b{tick}", queue_ms=10.0), b"")  # it waited behind a's
        clock.advance(0.020)
    clock.advance(late_s)
    workers.sent.clear()
    dispatcher.submit(_call("low", client="c", priority=2), results.append)
    assert _sent(workers) == ([] if held else ["low"])


async def test_no_slot_is_kept_free_for_a_client_with_no_steady_cadence(parts: Parts) -> None:
    dispatcher, _scheduler, workers, results = parts
    clock = dispatcher._clock
    assert isinstance(clock, FakeClock)
    _staging(parts)
    for i, gap in enumerate((0.005, 0.090, 0.020, 0.060)):  # an urgent client, erratic
        dispatcher.submit(_call(f"u{i}", client="u", priority=0), results.append)
        dispatcher.on_worker_reply(_ok(f"u{i}"), b"")
        clock.advance(gap)
    workers.sent.clear()
    dispatcher.submit(_call("low", client="c", priority=2), results.append)
    assert _sent(workers) == ["low"]


async def test_the_clients_due_are_kept_in_a_heap_that_does_not_grow_with_their_calls(
    parts: Parts,
) -> None:
    """A hold looks only at the clients due soon (a heap by next arrival); each call pushes its
    client's next arrival, and the entries it supersedes are dropped, not kept, also under a
    round robin, which never holds (so no hold clears the heap)."""
    dispatcher, _scheduler, _workers, results = parts
    clock = dispatcher._clock
    assert isinstance(clock, FakeClock)
    dispatcher.on_credit(_credit("c1", _spec(stage=1, strategy="round_robin")))
    for tick in range(200):
        for client in ("a", "b", "c"):
            dispatcher.submit(_call(f"{client}{tick}", client=client, priority=0), results.append)
            dispatcher.on_worker_reply(_ok(f"{client}{tick}"), b"")
        clock.advance(0.010)
    assert len(dispatcher._local._cadences["double"]) <= 2 * 3


async def test_a_silent_clients_cadence_is_forgotten(parts: Parts) -> None:
    """Client ids come and go (an SDK makes one per connection): what the holds learn of each
    is dropped once it has been silent for 10 s."""
    dispatcher, _scheduler, _workers, results = parts
    clock = dispatcher._clock
    assert isinstance(clock, FakeClock)
    dispatcher.on_credit(_credit("c1", _spec(stage=1)))
    for i in range(3):
        dispatcher.submit(_call(f"r{i}", client=f"client-{i}"), results.append)
        dispatcher.on_worker_reply(_ok(f"r{i}"), b"")
    share = dispatcher._local
    assert len(share._cadences["double"].clients) == 3
    clock.advance(11.0)
    share.forget_silent_clients()
    assert share._cadences == {}
