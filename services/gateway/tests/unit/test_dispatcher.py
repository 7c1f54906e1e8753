"""Dispatcher decisions with in-module doubles for its two links (the real links are covered e2e)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.common.errors import UnavailableError
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.gateway.calls import CallResult, InferenceCall
from loadmaster.gateway.dispatcher import Dispatcher
from loadmaster.v1 import errors_pb2, model_pool_pb2, scheduler_pb2


class _SchedulerDouble:
    def __init__(self) -> None:
        self.connected = True
        self.session = 1
        self.enqueued: list[scheduler_pb2.RequestInfo] = []
        self.completed: list[tuple[str, int, bool]] = []
        self.cancelled: list[str] = []
        self.returned: list[str] = []
        self.deferred: list[str] = []  # request ids whose Complete may wait
        self.order: list[str] = []  # "enqueue r1", "run r1", "complete r1", "return c1" as sent

    def enqueue(self, request: scheduler_pb2.RequestInfo) -> None:
        assert not request.credit_id
        self.enqueued.append(request)
        self.order.append(f"enqueue {request.request_id}")

    def report_run(self, request_id: str, model_id: str, info: Any) -> None:
        request = info()
        assert request.credit_id and (request.request_id, request.model_id) == (request_id, model_id)
        self.enqueued.append(request)
        self.order.append(f"run {request.request_id}")

    def complete(
        self,
        request_id: str,
        *,
        error_code: int = 0,
        retryable: bool = False,
        deferred: bool = False,
        **_: Any,
    ) -> None:
        self.completed.append((request_id, error_code, retryable))
        if deferred:
            self.deferred.append(request_id)
        self.order.append(f"complete {request_id}")

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def return_credit(self, credit_id: str) -> None:
        self.returned.append(credit_id)
        self.order.append(f"return {credit_id}")


class _WorkersDouble:
    def __init__(self) -> None:
        self.sent: list[tuple[str, model_pool_pb2.InferRequest]] = []
        self.refuse = False

    def send(self, endpoint: str, envelope: bytes, payload: Any) -> None:
        if self.refuse:
            raise UnavailableError(f"{endpoint} refused")
        self.sent.append((endpoint, model_pool_pb2.InferRequest.FromString(envelope)))


GRACE_S = 10.0
LOST_GRACE_S = 2.0


@pytest.fixture()
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture()
async def parts(
    clock: FakeClock,
) -> AsyncIterator[tuple[Dispatcher, _SchedulerDouble, _WorkersDouble, list[CallResult]]]:
    scheduler, workers = _SchedulerDouble(), _WorkersDouble()
    dispatcher = Dispatcher(
        scheduler=lambda _: scheduler,
        workers=lambda _: workers,
        telemetry=TelemetryReporter("gateway", "test", None),
        clock=clock,
        reply_grace_s=GRACE_S,
        lost_grace_s=LOST_GRACE_S,
    )
    dispatcher.start()
    results: list[CallResult] = []
    yield dispatcher, scheduler, workers, results
    await dispatcher.close()


async def _advance(clock: FakeClock, seconds: float) -> None:
    """Move the fake clock and let the reply watchdog run."""
    clock.advance(seconds)
    for _ in range(3):
        await asyncio.sleep(0)


def _call(request_id: str = "r1") -> InferenceCall:
    return InferenceCall(request_id=request_id, client_id="c", model_id="double", inputs=[], payload=b"abc")


def _grant(request_id: str = "r1", worker: str = "w1", attempt: int = 1) -> scheduler_pb2.Grant:
    return scheduler_pb2.Grant(
        request_id=request_id, worker_id=worker, data_endpoint=f"tcp://{worker}", attempt=attempt
    )


async def test_grant_sends_to_the_worker_and_its_reply_finishes_the_call_once(parts) -> None:
    dispatcher, scheduler, workers, results = parts
    dispatcher.submit(_call(), results.append)
    assert [r.request_id for r in scheduler.enqueued] == ["r1"]
    dispatcher.on_grant(_grant())
    assert workers.sent[0][0] == "tcp://w1" and workers.sent[0][1].request_id == "r1"
    reply = model_pool_pb2.InferResponse(request_id="r1", model_id="double", worker_id="w1")
    dispatcher.on_worker_reply(reply, b"out")
    dispatcher.on_worker_reply(reply, b"out")  # a duplicate is ignored
    assert len(results) == 1 and results[0].ok and results[0].payload == b"out"
    assert scheduler.completed == [("r1", 0, False)]
    assert dispatcher.inflight == 0


async def test_retryable_failure_waits_for_a_regrant_and_ignores_the_old_worker(parts) -> None:
    dispatcher, scheduler, _workers, results = parts
    dispatcher.submit(_call(), results.append)
    dispatcher.on_grant(_grant(worker="w1"))
    failure = model_pool_pb2.InferResponse(
        request_id="r1", worker_id="w1", error_code=errors_pb2.ERROR_CODE_UNAVAILABLE, retryable=True
    )
    dispatcher.on_worker_reply(failure, b"")
    assert results == [] and scheduler.completed == [("r1", errors_pb2.ERROR_CODE_UNAVAILABLE, True)]
    dispatcher.on_grant(_grant(worker="w2", attempt=2))
    dispatcher.on_worker_reply(model_pool_pb2.InferResponse(request_id="r1", worker_id="w1"), b"late")
    assert results == []
    dispatcher.on_worker_reply(model_pool_pb2.InferResponse(request_id="r1", worker_id="w2"), b"ok")
    assert len(results) == 1 and results[0].payload == b"ok"


async def test_reject_answers_with_the_typed_error(parts) -> None:
    dispatcher, _, _, results = parts
    dispatcher.submit(_call(), results.append)
    dispatcher.on_reject(
        scheduler_pb2.Reject(request_id="r1", error_code=errors_pb2.ERROR_CODE_NOT_FOUND, message="no model")
    )
    assert results[0].error is not None and results[0].error.edge_code == "not_found"


async def test_losing_the_scheduler_answers_only_the_calls_waiting_for_a_grant(parts) -> None:
    dispatcher, _, _, results = parts
    dispatcher.submit(_call("waiting"), results.append)
    dispatcher.submit(_call("running"), results.append)
    dispatcher.on_grant(_grant("running"))
    dispatcher.on_scheduler_lost()
    assert [(r.request_id, r.error.edge_code) for r in results if r.error] == [("waiting", "unavailable")]
    dispatcher.on_worker_reply(model_pool_pb2.InferResponse(request_id="running", worker_id="w1"), b"")
    assert [r.request_id for r in results] == ["waiting", "running"]


async def test_a_disconnected_scheduler_means_unavailable_at_once(parts) -> None:
    dispatcher, scheduler, _, results = parts
    scheduler.connected = False
    dispatcher.submit(_call(), results.append)
    assert results[0].error is not None and results[0].error.edge_code == "unavailable"
    assert scheduler.enqueued == []


async def test_a_worker_that_cannot_take_the_request_is_reported_retryable(parts) -> None:
    dispatcher, scheduler, workers, results = parts
    workers.refuse = True
    dispatcher.submit(_call(), results.append)
    dispatcher.on_grant(_grant())
    assert results == []
    assert scheduler.completed == [("r1", errors_pb2.ERROR_CODE_UNAVAILABLE, True)]


async def test_a_worker_that_never_replies_is_answered_expired_by_the_watchdog(parts, clock) -> None:
    dispatcher, scheduler, _, results = parts
    dispatcher.submit(_call(), results.append)
    grant = _grant()
    grant.deadline_unix_ns = int((clock.time() + 5.0) * 1e9)
    dispatcher.on_grant(grant)
    await _advance(clock, 5.0 + GRACE_S - 0.5)
    assert results == []  # the deadline + grace has not passed yet
    await _advance(clock, 1.0)
    assert results[0].error is not None and results[0].error.edge_code == "expired"
    assert scheduler.completed == [("r1", errors_pb2.ERROR_CODE_EXPIRED, False)]


async def test_cancel_before_the_grant_gives_back_the_slot_when_it_comes(parts) -> None:
    dispatcher, scheduler, workers, results = parts
    dispatcher.submit(_call(), results.append)
    dispatcher.cancel("r1")
    assert scheduler.cancelled == ["r1"]
    dispatcher.on_grant(_grant())
    assert workers.sent == [] and results == []
    assert scheduler.completed == [("r1", errors_pb2.ERROR_CODE_CANCELLED, False)]


def _credit(credit_id: str = "c1", worker: str = "w1", ttl_ms: float = 500.0) -> scheduler_pb2.Credit:
    return scheduler_pb2.Credit(
        credit_id=credit_id,
        model_id="double",
        worker_id=worker,
        data_endpoint=f"tcp://{worker}",
        generation=3,
        request_ttl_ms=ttl_ms,
    )


def _ok(request_id: str, worker: str = "w1") -> model_pool_pb2.InferResponse:
    return model_pool_pb2.InferResponse(request_id=request_id, model_id="double", worker_id=worker)


async def test_a_call_on_an_idle_credit_goes_straight_to_the_worker(parts, clock) -> None:
    dispatcher, scheduler, workers, results = parts
    dispatcher.on_credit(_credit())
    dispatcher.submit(_call("r1"), results.append)
    [(endpoint, request)] = workers.sent
    assert (endpoint, request.generation) == ("tcp://w1", 3)
    assert request.deadline_unix_ns == int((clock.time() + 0.5) * 1e9)  # now + the credit's TTL
    assert [(e.request_id, e.credit_id) for e in scheduler.enqueued] == [("r1", "c1")]
    dispatcher.submit(_call("r2"), results.append)  # the only credit is busy: asks the scheduler
    assert scheduler.enqueued[-1].credit_id == "" and len(workers.sent) == 1
    dispatcher.on_worker_reply(_ok("r1"), b"out")
    assert results[0].ok and scheduler.completed == [("r1", 0, False)]
    assert scheduler.deferred == ["r1"]  # the credit stays usable: nothing waits on it
    dispatcher.submit(_call("r3"), results.append)  # the credit is idle again
    assert scheduler.enqueued[-1].credit_id == "c1"
    assert scheduler.returned == []


async def test_idle_credits_take_turns(parts) -> None:
    dispatcher, scheduler, _workers, results = parts
    dispatcher.on_credit(_credit("c1"))
    dispatcher.on_credit(_credit("c2"))
    for request_id in ("r1", "r2", "r3"):
        dispatcher.submit(_call(request_id), results.append)
        dispatcher.on_worker_reply(_ok(request_id), b"")
    assert [e.credit_id for e in scheduler.enqueued] == ["c1", "c2", "c1"]


async def test_each_credit_run_is_reported_as_a_run_then_its_end(parts) -> None:
    dispatcher, scheduler, _workers, results = parts
    dispatcher.on_credit(_credit())
    dispatcher.submit(_call("r1"), results.append)
    dispatcher.on_worker_reply(_ok("r1"), b"")
    dispatcher.submit(_call("r2"), results.append)
    dispatcher.on_worker_reply(_ok("r2"), b"")
    assert scheduler.order == ["run r1", "complete r1", "run r2", "complete r2"]
    assert [e.credit_id for e in scheduler.enqueued] == ["c1", "c1"]
    assert scheduler.deferred == ["r1", "r2"]


async def test_a_call_on_a_revoked_credit_reports_its_end_at_once(parts) -> None:
    dispatcher, scheduler, _workers, results = parts
    dispatcher.on_credit(_credit())
    dispatcher.submit(_call("r1"), results.append)
    dispatcher.on_revoke("c1")
    dispatcher.on_worker_reply(_ok("r1"), b"")
    assert scheduler.order == ["run r1", "complete r1", "return c1"]
    assert scheduler.deferred == []  # the credit goes back: the scheduler must see the end first


async def test_a_revoked_credit_is_returned_at_once_when_idle_else_when_its_call_ends(parts) -> None:
    dispatcher, scheduler, _workers, results = parts
    dispatcher.on_credit(_credit("c1"))
    dispatcher.on_credit(_credit("c2"))
    dispatcher.submit(_call("r1"), results.append)  # runs on c1 (idle the longest)
    dispatcher.on_revoke("c1")
    dispatcher.on_revoke("c2")
    assert scheduler.returned == ["c2"]
    dispatcher.submit(_call("r2"), results.append)  # no credit left to use
    assert scheduler.enqueued[-1].credit_id == ""
    dispatcher.on_worker_reply(_ok("r1"), b"")
    assert scheduler.returned == ["c2", "c1"]
    dispatcher.on_revoke("c9")  # unknown: ignored


async def test_a_retryable_failure_on_a_credit_returns_it_and_follows_the_regrant(parts) -> None:
    dispatcher, scheduler, workers, results = parts
    dispatcher.on_credit(_credit())
    dispatcher.submit(_call("r1"), results.append)
    failure = model_pool_pb2.InferResponse(
        request_id="r1", worker_id="w1", error_code=errors_pb2.ERROR_CODE_UNAVAILABLE, retryable=True
    )
    dispatcher.on_worker_reply(failure, b"")
    assert scheduler.completed == [("r1", errors_pb2.ERROR_CODE_UNAVAILABLE, True)]
    assert scheduler.returned == ["c1"] and results == []
    dispatcher.on_grant(_grant("r1", worker="w2", attempt=2))
    assert workers.sent[-1][0] == "tcp://w2"
    dispatcher.on_worker_reply(_ok("r1", worker="w2"), b"ok")
    assert len(results) == 1 and results[0].ok


async def test_an_unreachable_credit_worker_falls_back_to_the_scheduler(parts) -> None:
    dispatcher, scheduler, workers, results = parts
    dispatcher.on_credit(_credit())
    workers.refuse = True
    dispatcher.submit(_call("r1"), results.append)
    assert scheduler.returned == ["c1"]
    assert [(e.request_id, e.credit_id) for e in scheduler.enqueued] == [("r1", "")]
    assert results == []


async def test_a_new_scheduler_session_voids_credits_but_running_calls_still_finish(parts) -> None:
    dispatcher, scheduler, _workers, results = parts
    dispatcher.on_credit(_credit())
    dispatcher.submit(_call("r1"), results.append)
    dispatcher.on_scheduler_lost()
    assert results == []  # it is running on the worker, not waiting for a grant
    scheduler.session = 2  # a session to a scheduler (perhaps another one) opened meanwhile ...
    echo = _credit("e1")
    echo.model_id = "echo"
    dispatcher.on_credit(echo)  # ... and its scheduler knows a worker
    dispatcher.on_worker_reply(_ok("r1"), b"")
    assert results[0].ok and scheduler.returned == []
    dispatcher.submit(_call("r2"), results.append)
    assert scheduler.enqueued[-1].credit_id == ""  # the old session's credit is gone
    assert scheduler.returned == []  # and never returned to a scheduler that did not lend it


async def test_while_the_scheduler_is_away_calls_run_on_the_lost_session_s_credits(parts) -> None:
    dispatcher, scheduler, workers, results = parts
    dispatcher.on_credit(_credit("c1"))
    dispatcher.on_scheduler_lost()
    scheduler.connected = False
    dispatcher.submit(_call("r1"), results.append)
    assert [request.request_id for _, request in workers.sent] == ["r1"]  # straight to the worker
    assert scheduler.enqueued == []
    dispatcher.submit(_call("r2"), results.append)  # the share is busy: no other way to serve it
    assert [(r.request_id, r.error.edge_code) for r in results if r.error] == [("r2", "unavailable")]
    dispatcher.on_worker_reply(_ok("r1"), b"out")
    assert [r.request_id for r in results if r.ok] == ["r1"]
    dispatcher.submit(_call("r3"), results.append)  # the credit is idle again: reused
    dispatcher.on_worker_reply(_ok("r3"), b"out")
    assert [r.request_id for r in results if r.ok] == ["r1", "r3"]
    other = InferenceCall(request_id="r4", client_id="c", model_id="echo", inputs=[], payload=b"")
    dispatcher.submit(other, results.append)  # no share of that model
    assert results[-1].request_id == "r4" and results[-1].error.edge_code == "unavailable"

    scheduler.connected, scheduler.session = True, 2  # the standby took over; no worker yet
    dispatcher.submit(_call("r5"), results.append)  # still on the old share, unreported
    assert workers.sent[-1][1].request_id == "r5" and scheduler.enqueued == []
    dispatcher.on_worker_reply(_ok("r5"), b"out")
    assert results[-1].request_id == "r5" and results[-1].ok
    dispatcher.on_credit(_credit("n1"))  # the new leader knows the worker and lends its own
    dispatcher.submit(_call("r6"), results.append)
    assert [(e.request_id, e.credit_id) for e in scheduler.enqueued] == [("r6", "n1")]
    dispatcher.on_worker_reply(_ok("r6"), b"out")
    dispatcher.submit(_call("r7"), results.append)  # n1 runs r7; c1 was dropped, not used
    dispatcher.submit(_call("r8"), results.append)
    assert [(e.request_id, e.credit_id) for e in scheduler.enqueued[1:]] == [("r7", "n1"), ("r8", "")]
    assert scheduler.returned == []  # c1 never goes back to a scheduler that did not lend it


async def test_a_new_leader_s_credits_under_the_old_ids_are_kept_apart(parts) -> None:
    """A scheduler that takes over numbers its credits from c1 again. Dropping the old session's
    c1 (idle) or ending its call (busy) must not drop the new c1: the gateway would then hold no
    credit while the scheduler holds it lent, and hand its calls back forever (seen in
    test_scheduler_failover under load)."""
    dispatcher, scheduler, _workers, results = parts
    dispatcher.on_credit(_credit("c1"))
    dispatcher.on_credit(_credit("c2"))
    dispatcher.submit(_call("r1"), results.append)  # busy on the old c1
    dispatcher.on_scheduler_lost()
    scheduler.session = 2
    dispatcher.on_credit(_credit("c1"))  # the new leader's, same ids
    dispatcher.on_credit(_credit("c2"))
    dispatcher.on_worker_reply(_ok("r1"), b"out")  # the old c1's call ends
    for n in range(2, 6):  # the old c2 is dropped on the way; the new ones serve every call
        dispatcher.submit(_call(f"r{n}"), results.append)
        dispatcher.on_worker_reply(_ok(f"r{n}"), b"out")
    assert [r.request_id for r in results if r.ok] == ["r1", "r2", "r3", "r4", "r5"]
    assert [(e.request_id, e.credit_id) for e in scheduler.enqueued[1:]] == [  # (r1: run on the old c1)
        ("r2", "c1"),
        ("r3", "c2"),
        ("r4", "c1"),
        ("r5", "c2"),
    ]
    assert scheduler.returned == []


async def test_a_call_on_an_earlier_session_s_share_is_answered_when_its_worker_dies(parts) -> None:
    dispatcher, scheduler, _workers, results = parts
    dispatcher.on_credit(_credit("c1"))
    dispatcher.on_scheduler_lost()
    scheduler.session = 2  # reconnected; the new scheduler has granted nothing yet
    dispatcher.submit(_call("r1"), results.append)  # on c1, which the new scheduler never lent
    dispatcher.on_worker_lost("tcp://w1")
    # The new scheduler never heard of r1 and will not re-grant it: answered now, not left hanging.
    assert [(r.request_id, r.error.edge_code) for r in results if r.error] == [("r1", "unavailable")]
    assert dispatcher.inflight == 0


async def test_a_lost_worker_s_calls_wait_for_the_scheduler_s_regrant(parts, clock) -> None:
    dispatcher, scheduler, workers, results = parts
    dispatcher.submit(_call("r1"), results.append)
    dispatcher.on_grant(_grant("r1", worker="w1"))
    dispatcher.on_worker_lost("tcp://w1")
    await _advance(clock, LOST_GRACE_S / 2)
    dispatcher.on_grant(_grant("r1", worker="w2", attempt=2))  # it saw the worker's stream end
    await _advance(clock, LOST_GRACE_S)
    assert scheduler.completed == [] and results == []  # no retry spent on the dead worker
    dispatcher.on_worker_reply(_ok("r1", worker="w2"), b"ok")
    assert results[0].ok and workers.sent[-1][0] == "tcp://w2"


async def test_a_lost_worker_hands_its_calls_back_to_the_scheduler_that_knows_them(parts, clock) -> None:
    dispatcher, scheduler, workers, results = parts
    dispatcher.submit(_call("r1"), results.append)
    dispatcher.submit(_call("r2"), results.append)
    dispatcher.on_grant(_grant("r1", worker="w1"))
    dispatcher.on_grant(_grant("r2", worker="w2"))
    dispatcher.on_worker_lost("tcp://w1")
    assert scheduler.completed == []  # the scheduler may re-grant it on its own first
    await _advance(clock, LOST_GRACE_S + 0.5)
    assert results == []  # retryable: the scheduler queues it again (or answers it)
    assert scheduler.completed == [("r1", errors_pb2.ERROR_CODE_UNAVAILABLE, True)]
    dispatcher.on_grant(_grant("r1", worker="w2", attempt=2))
    assert workers.sent[-1][0] == "tcp://w2"
    dispatcher.on_worker_reply(_ok("r1", worker="w2"), b"ok")
    dispatcher.on_worker_reply(_ok("r2", worker="w2"), b"ok")
    assert [r.ok for r in results] == [True, True]


async def test_a_lost_worker_s_calls_of_an_earlier_scheduler_session_are_answered_at_once(
    parts, clock
) -> None:
    dispatcher, scheduler, _workers, results = parts
    dispatcher.submit(_call("old"), results.append)
    dispatcher.on_grant(_grant("old"))
    scheduler.session = 2  # the scheduler restarted: its new session never heard of "old"
    dispatcher.submit(_call("new"), results.append)
    dispatcher.on_grant(_grant("new"))
    dispatcher.on_worker_lost("tcp://w1")
    assert [(r.request_id, r.error.edge_code) for r in results if r.error] == [("old", "unavailable")]
    await _advance(clock, LOST_GRACE_S + 0.5)
    assert scheduler.completed == [("new", errors_pb2.ERROR_CODE_UNAVAILABLE, True)]
    assert dispatcher.inflight == 1  # "new" waits for the scheduler's answer


async def test_a_lost_worker_s_calls_are_answered_at_once_while_the_scheduler_is_away(parts) -> None:
    dispatcher, scheduler, _workers, results = parts
    dispatcher.on_credit(_credit())
    dispatcher.submit(_call("r1"), results.append)  # runs on the credit
    dispatcher.on_scheduler_lost()
    scheduler.connected = False
    dispatcher.on_worker_lost("tcp://w1")
    assert [(r.request_id, r.error.edge_code) for r in results if r.error] == [("r1", "unavailable")]
    assert dispatcher.inflight == 0


async def test_a_retryable_failure_of_an_earlier_session_s_call_is_answered(parts) -> None:
    dispatcher, scheduler, _workers, results = parts
    dispatcher.submit(_call(), results.append)
    dispatcher.on_grant(_grant())
    scheduler.session = 2
    failure = model_pool_pb2.InferResponse(
        request_id="r1", worker_id="w1", error_code=errors_pb2.ERROR_CODE_UNAVAILABLE, retryable=True
    )
    dispatcher.on_worker_reply(failure, b"")
    assert results[0].error is not None and results[0].error.edge_code == "unavailable"
    assert scheduler.completed == []


async def test_the_calls_in_flight_are_described_by_where_they_wait(parts) -> None:
    dispatcher, _scheduler, _workers, results = parts
    for request_id in ("queued", "running", "orphaned"):
        dispatcher.submit(_call(request_id), results.append)
    dispatcher.on_grant(_grant("running", worker="w1"))
    dispatcher.on_grant(_grant("orphaned", worker="w2"))
    dispatcher.on_worker_lost("tcp://w2")
    assert dispatcher.describe_inflight() == [
        "queued (double, waiting for the scheduler)",
        "running (double, on worker w1)",
        "orphaned (double, on worker w2 (its link lost))",
    ]
    assert len(dispatcher.describe_inflight(most=1)) == 1
