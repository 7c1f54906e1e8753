"""An instance's own thread: order, one thread, results and errors, shutdown."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from loadmaster.common.errors import InternalError
from loadmaster.model_pool.instance_thread import InstanceThread


@pytest.fixture
def thread() -> Iterator[InstanceThread]:
    worker = InstanceThread("test-instance")
    yield worker
    worker.shutdown()
    assert worker.join(5)


def test_posted_work_runs_in_order_on_one_thread_that_is_not_the_callers(thread: InstanceThread) -> None:
    gate = threading.Event()
    seen: list[tuple[int, str]] = []
    thread.post(gate.wait, 5)  # everything below queues behind it
    for index in range(50):
        thread.post(lambda i: seen.append((i, threading.current_thread().name)), index)
    gate.set()
    assert thread.submit(len, seen).result(timeout=5) == 50
    assert [i for i, _ in seen] == list(range(50))
    assert {name for _, name in seen} == {"test-instance"}
    assert threading.current_thread().name != "test-instance"


def test_submit_returns_the_result_or_the_exception(thread: InstanceThread) -> None:
    assert thread.submit(pow, 2, 10).result(timeout=5) == 1024
    with pytest.raises(ZeroDivisionError):
        thread.submit(lambda: 1 / 0).result(timeout=5)
    assert thread.submit(str.upper, "still serving").result(timeout=5) == "STILL SERVING"


def test_posted_work_that_raises_is_logged_and_the_thread_goes_on(
    thread: InstanceThread, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> None:
        raise ValueError("broken work")

    thread.post(broken)
    assert thread.submit(lambda: "next").result(timeout=5) == "next"
    assert any("test-instance" in record.getMessage() for record in caplog.records)
    assert any(record.exc_info and "broken work" in str(record.exc_info[1]) for record in caplog.records)


def test_shutdown_runs_the_work_already_handed_over_then_ends() -> None:
    worker = InstanceThread("test-shutdown")
    gate = threading.Event()
    done: list[int] = []
    worker.post(gate.wait, 5)
    worker.post(done.append, 1)
    later = worker.submit(done.append, 2)
    worker.shutdown()
    worker.shutdown()  # idempotent
    assert not worker.join(0.01)  # still held by the gate, with work queued
    gate.set()
    assert worker.join(5)
    assert done == [1, 2]
    assert later.done() and later.exception() is None


def test_work_handed_over_after_shutdown_fails_clearly() -> None:
    worker = InstanceThread("test-closed")
    worker.shutdown()
    assert worker.join(5)
    with pytest.raises(InternalError, match="instance thread test-closed is shut down"):
        worker.post(print, "never")
    with pytest.raises(InternalError, match="shut down"):
        worker.submit(print, "never")


def test_a_cancelled_submission_does_not_run(thread: InstanceThread) -> None:
    gate = threading.Event()
    ran: list[int] = []
    thread.post(gate.wait, 5)
    waiting = thread.submit(ran.append, 1)
    assert waiting.cancel()
    gate.set()
    assert thread.submit(ran.append, 2).result(timeout=5) is None
    assert ran == [2]
