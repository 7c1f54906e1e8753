"""Hand-offs: the engine thread (one thread, calls in order, Futures for lifecycle calls, posts
without) and the loop inbox (calls from other threads, run on the loop in order)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from loadmaster.model_pool.engine_thread import EngineThread, LoopInbox


def test_posts_and_submits_run_in_order_on_one_named_thread() -> None:
    thread = EngineThread("model-m-0")
    seen: list[tuple[str, str]] = []
    try:
        for index in range(20):
            thread.post(lambda i: seen.append((f"post-{i}", threading.current_thread().name)), index)
        last = thread.submit(lambda: seen.append(("submit", threading.current_thread().name)))
        last.result(timeout=5)
    finally:
        thread.shutdown()
    assert [label for label, _ in seen] == [f"post-{i}" for i in range(20)] + ["submit"]
    assert {name for _, name in seen} == {"model-m-0"}


def test_submit_carries_the_result_or_the_error() -> None:
    thread = EngineThread("model-m-0")
    try:
        assert thread.submit(lambda a, b=0: a + b, 2, b=3).result(timeout=5) == 5
        with pytest.raises(ZeroDivisionError):
            thread.submit(lambda: 1 / 0).result(timeout=5)
    finally:
        thread.shutdown()


def test_a_failing_post_is_logged_and_the_thread_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    thread = EngineThread("model-m-0")
    try:
        thread.post(lambda: 1 / 0)
        assert thread.submit(lambda: "alive").result(timeout=5) == "alive"
    finally:
        thread.shutdown()
    assert "model-m-0: a call failed" in caplog.text


def test_shutdown_runs_what_was_given_then_refuses_more() -> None:
    thread = EngineThread("model-m-0")
    gate = threading.Event()
    ran: list[int] = []
    thread.post(gate.wait, 5)
    pending = thread.submit(ran.append, 1)
    thread.shutdown(wait=False)
    gate.set()
    pending.result(timeout=5)
    thread.shutdown()  # twice is fine; waits for the thread to end
    assert ran == [1]
    with pytest.raises(RuntimeError, match="shut down"):
        thread.post(ran.append, 2)
    with pytest.raises(RuntimeError, match="shut down"):
        thread.submit(ran.append, 3)


async def test_the_loop_runs_calls_on_it_as_on_any_executor() -> None:
    thread = EngineThread("model-m-0")
    try:
        name = await asyncio.get_running_loop().run_in_executor(
            thread, lambda: threading.current_thread().name
        )
        assert name == "model-m-0"
    finally:
        thread.shutdown()


async def test_the_inbox_runs_posts_from_other_threads_on_the_loop_in_order(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = asyncio.get_running_loop()
    inbox = LoopInbox(loop)
    seen: list[tuple[int, bool]] = []
    finished = asyncio.Event()
    loop_thread = threading.current_thread()

    def record(index: int) -> None:
        seen.append((index, threading.current_thread() is loop_thread))
        if index == 99:
            finished.set()

    def produce() -> None:
        for index in range(100):
            if index == 50:
                inbox.post(lambda: 1 / 0)  # logged; the calls after it still run
            inbox.post(record, index)

    try:
        producer = threading.Thread(target=produce)
        producer.start()
        await asyncio.wait_for(finished.wait(), 5)
        producer.join()
    finally:
        inbox.close()
        inbox.close()  # twice is fine
    assert seen == [(index, True) for index in range(100)]
    assert "a call posted to the event loop failed" in caplog.text
