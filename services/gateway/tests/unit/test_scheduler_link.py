"""The Session outbox: what goes into which message, and when (no stream; the generator
is driven by hand)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from loadmaster.gateway.scheduler_link import SchedulerLink
from loadmaster.v1 import errors_pb2, scheduler_pb2

_DELAY_S = 0.05


def _run(request_id: str, credit_id: str) -> scheduler_pb2.RequestInfo:
    return scheduler_pb2.RequestInfo(request_id=request_id, model_id="double", credit_id=credit_id)


def _report(link: SchedulerLink, request_id: str, credit_id: str) -> None:
    link.report_run(request_id, "double", lambda: _run(request_id, credit_id))


def _plain(request_id: str) -> scheduler_pb2.RequestInfo:
    return scheduler_pb2.RequestInfo(request_id=request_id, model_id="double")


@pytest.fixture()
async def session() -> tuple[SchedulerLink, AsyncIterator[scheduler_pb2.SessionRequest]]:
    link = SchedulerLink(
        "127.0.0.1:1", "gw", on_grant=print, on_reject=print, on_lost=print, report_delay_s=_DELAY_S
    )
    link._connected.set()  # as after the stream opened
    outgoing = link._outgoing(link._outbox)
    hello = await anext(outgoing)
    assert hello.HasField("hello")
    return link, outgoing


def _ids(message: scheduler_pb2.SessionRequest) -> dict[str, list[str]]:
    return {
        "complete": [c.request_id for c in message.complete],
        "finished": [f.request.request_id for f in message.finished_run],
        "return": list(message.return_credit),
        "enqueue": [e.request_id for e in message.enqueue],
        "tally": [f"{t.model_id}/{t.worker_id}: {t.runs} runs, {t.failed} failed" for t in message.run_tally],
    }


async def test_credit_runs_wait_for_the_report_delay_and_leave_together(session) -> None:
    link, outgoing = session
    loop = asyncio.get_running_loop()
    started = loop.time()
    _report(link, "r1", "c1")
    link.complete("r1", worker_id="w1", inference_ms=0.5, deferred=True)
    _report(link, "r2", "c1")
    link.complete(
        "r2", worker_id="w1", inference_ms=0.25, error_code=errors_pb2.ERROR_CODE_INTERNAL, deferred=True
    )
    _report(link, "r3", "c1")  # still running when the message leaves
    message = await asyncio.wait_for(anext(outgoing), 2.0)
    assert loop.time() - started >= _DELAY_S * 0.9
    # r1 and r2 ended before their report left and need nothing more: counted, not listed
    assert _ids(message) == {
        "complete": [],
        "finished": [],
        "return": [],
        "enqueue": ["r3"],
        "tally": ["double/w1: 2 runs, 1 failed"],
    }
    assert message.run_tally[0].inference_ms == 0.75
    assert message.enqueue[0].credit_id == "c1"
    assert not link._outbox


async def test_a_report_that_cannot_wait_takes_the_waiting_runs_along_at_once(session) -> None:
    link, outgoing = session
    _report(link, "r1", "c1")
    link.complete("r1", deferred=True)
    link.enqueue(_plain("r2"))  # needs a grant: no delay
    message = await asyncio.wait_for(anext(outgoing), _DELAY_S / 2)
    assert _ids(message) == {
        "complete": [],
        "finished": [],
        "return": [],
        "enqueue": ["r2"],
        "tally": ["double/: 1 runs, 0 failed"],
    }


async def test_a_run_already_sent_is_completed_in_a_later_message(session) -> None:
    link, outgoing = session
    _report(link, "r1", "c1")
    link.enqueue(_plain("r2"))
    assert _ids(await anext(outgoing))["enqueue"] == ["r1", "r2"]
    link.complete("r1", error_code=errors_pb2.ERROR_CODE_UNAVAILABLE, retryable=True)
    message = await asyncio.wait_for(anext(outgoing), _DELAY_S / 2)
    assert _ids(message)["complete"] == ["r1"] and message.complete[0].retryable


async def test_a_run_that_failed_retryably_before_its_report_goes_whole_before_its_credit_returns(
    session,
) -> None:
    link, outgoing = session
    _report(link, "r1", "c1")
    link.complete("r1", worker_id="w1", error_code=errors_pb2.ERROR_CODE_UNAVAILABLE, retryable=True)
    link.return_credit("c1")
    message = await asyncio.wait_for(anext(outgoing), _DELAY_S / 2)
    assert _ids(message) == {"complete": [], "finished": ["r1"], "return": ["c1"], "enqueue": [], "tally": []}
    assert message.finished_run[0].request.credit_id == "c1" and message.finished_run[0].complete.retryable


async def test_a_credits_next_run_never_leaves_before_its_earlier_ends() -> None:
    link = SchedulerLink("127.0.0.1:1", "gw", on_grant=print, on_reject=print, on_lost=print, max_batch=1)
    link._connected.set()
    outgoing = link._outgoing(link._outbox)
    await anext(outgoing)
    # r1 ran on c1 and r2 on c2; both runs were sent before they ended.
    _report(link, "r1", "c1")
    _report(link, "r2", "c2")
    link.enqueue(_plain("x"))
    assert _ids(await anext(outgoing))["enqueue"] == ["r1", "x"]  # one run, one enqueue
    assert _ids(await anext(outgoing))["enqueue"] == ["r2"]
    link.complete("r1")
    link.complete("r2")
    _report(link, "r3", "c1")
    first, second = await anext(outgoing), await anext(outgoing)
    # One Complete per message (max_batch 1): r3 waits until no earlier end is left behind.
    assert _ids(first) == {"complete": ["r1"], "finished": [], "return": [], "enqueue": [], "tally": []}
    assert _ids(second) == {"complete": ["r2"], "finished": [], "return": [], "enqueue": ["r3"], "tally": []}


async def test_losing_the_session_drops_what_waited_and_its_timer(session) -> None:
    link, _outgoing = session
    _report(link, "r1", "c1")
    link.complete("r1", deferred=True)
    timer = link._outbox.report_timer
    assert timer is not None
    link._mark_lost()
    assert timer.cancelled()
    assert not link._outbox  # the scheduler forgot the lost session's runs


async def test_reports_that_arrive_while_a_message_is_written_wait_for_the_next_tick(session) -> None:
    """Under load every write completion found a few new reports and sent them at once: one
    stream message per request instead of one per report delay."""
    link, outgoing = session
    loop = asyncio.get_running_loop()
    link.enqueue(_plain("q1"))
    first = await asyncio.wait_for(anext(outgoing), 2.0)
    assert _ids(first)["enqueue"] == ["q1"]
    # While `first` is being written: a run is reported, and the local queue depth changes.
    _report(link, "r1", "c1")
    link.report_local_depth("double", 3)
    started = loop.time()
    second = await asyncio.wait_for(anext(outgoing), 2.0)
    assert loop.time() - started >= _DELAY_S * 0.9
    assert _ids(second)["enqueue"] == ["r1"]
    assert [(d.model_id, d.waiting) for d in second.local_queue_depth] == [("double", 3)]


async def test_the_session_channel_probes_as_a_live_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """A silent scheduler is left within 1.8 s (docs/liveness.md): the session's channel gets
    the live links' keepalive, not the gentle default of other channels."""
    from loadmaster.common.liveness import LIVENESS
    from loadmaster.gateway import scheduler_link

    opened: list[dict[str, object]] = []

    def channel(address: str, *, options: list[tuple[str, object]] | None = None) -> None:
        opened.append(dict(options or []))
        raise OSError("no network in a unit test")

    monkeypatch.setattr(scheduler_link, "aio_channel", channel)
    link = SchedulerLink("127.0.0.1:1", "gw", on_grant=print, on_reject=print, on_lost=print)
    link.start()
    for _ in range(100):
        if opened:
            break
        await asyncio.sleep(0.01)
    await link.close()
    assert opened
    assert set(dict(LIVENESS.grpc_options()).items()) <= set(opened[0].items())
