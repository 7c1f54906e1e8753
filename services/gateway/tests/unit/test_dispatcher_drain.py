"""The dispatcher's drain (the gateway's SIGTERM): new calls are refused `unavailable` at once,
the calls in flight are answered, and `drain` returns when the last one is (or at its bound).
The scheduler and worker links are in-module doubles; tests/e2e/test_drain.py runs the real thing."""

from __future__ import annotations

import asyncio
from typing import Any

from loadmaster.common.clock import FakeClock
from loadmaster.common.errors import UnavailableError
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.gateway.calls import CallResult, InferenceCall
from loadmaster.gateway.dispatcher import Dispatcher
from loadmaster.v1 import model_pool_pb2, scheduler_pb2

ENDPOINT = "tcp://10.0.0.7:5556"


class _Scheduler:
    connected = True
    session = 1

    def enqueue(self, request: scheduler_pb2.RequestInfo) -> None:
        pass

    def complete(self, request_id: str, **_: Any) -> None:
        pass

    def cancel(self, request_id: str) -> None:
        pass


class _Workers:
    def send(self, endpoint: str, envelope: bytes, payload: Any) -> None:
        pass


def _dispatcher() -> Dispatcher:
    return Dispatcher(
        scheduler=lambda _: _Scheduler(),
        workers=lambda _: _Workers(),
        telemetry=TelemetryReporter("gateway", "test", None),
        clock=FakeClock(),  # a drain waits in real time: a test clock must not hold a stop
    )


def _submit(dispatcher: Dispatcher, results: list[CallResult], request_id: str) -> None:
    call = InferenceCall(request_id=request_id, client_id="c", model_id="m", inputs=[], payload=b"")
    dispatcher.submit(call, results.append)


def _answer(dispatcher: Dispatcher, request_id: str) -> None:
    dispatcher.on_grant(
        scheduler_pb2.Grant(request_id=request_id, worker_id="w1", data_endpoint=ENDPOINT, attempt=1)
    )
    dispatcher.on_worker_reply(
        model_pool_pb2.InferResponse(request_id=request_id, model_id="m", worker_id="w1"), b""
    )


async def test_a_drain_refuses_new_calls_and_returns_when_the_last_call_in_flight_is_answered() -> None:
    dispatcher = _dispatcher()
    results: list[CallResult] = []
    _submit(dispatcher, results, "old-1")
    _submit(dispatcher, results, "old-2")
    draining = asyncio.ensure_future(dispatcher.drain(30.0))
    await asyncio.sleep(0)
    _submit(dispatcher, results, "new")
    [refused] = results
    assert refused.request_id == "new" and isinstance(refused.error, UnavailableError)
    assert "shutting down" in refused.error.message
    _answer(dispatcher, "old-1")
    await asyncio.sleep(0)
    assert not draining.done()  # one call is still in flight
    _answer(dispatcher, "old-2")
    assert await asyncio.wait_for(draining, 5) == 0
    assert [(r.request_id, r.ok) for r in results[1:]] == [("old-1", True), ("old-2", True)]


async def test_a_drain_with_nothing_in_flight_returns_at_once_and_one_bounded_returns_what_is_left() -> None:
    assert await asyncio.wait_for(_dispatcher().drain(30.0), 5) == 0
    dispatcher = _dispatcher()
    _submit(dispatcher, [], "stuck")
    assert await asyncio.wait_for(dispatcher.drain(0.05), 5) == 1
