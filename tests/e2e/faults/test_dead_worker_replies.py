"""kill -9 the only model-pool worker while a stock Inferential client has requests in flight:
every request gets exactly one reply (a result or an error), within a bounded time.

Two cases. With the scheduler that granted the requests still up, it re-queues what the dead
worker held and answers it (here: at the request TTL, no worker being left). After a scheduler
restart, the new scheduler never heard of the requests still running on the worker, so only
the gateway can answer them: it sees the worker's data link drop and answers `unavailable` at
once, instead of leaving them to its reply watchdog (deadline + reply grace).
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import numpy as np
import pytest
from inferential import Connection

from loadmaster.cli.launcher import Suite

pytestmark = pytest.mark.slow

TTL_S = 5.0  # the example config's request TTL


def _kill(suite: Suite, name: str) -> float:
    service = suite.service(name)
    assert service is not None
    os.kill(service.process.pid, signal.SIGKILL)
    service.process.wait(5)
    return time.monotonic()


def _collect(model, count: int, *, since: float, bound_s: float) -> list[dict]:
    """`count` replies within `bound_s` of `since`; then none more for a second."""
    replies = []
    for _ in range(count):
        remaining_ms = max(1, int((since + bound_s - time.monotonic()) * 1000))
        result = model.get_result(timeout_ms=remaining_ms)
        assert result is not None, f"{len(replies)} of {count} answered within {bound_s}s"
        replies.append(result)
    assert model.get_result(timeout_ms=1000) is None, "a request was answered twice"
    return replies


def test_requests_on_a_killed_worker_are_answered(make_suite) -> None:
    suite = make_suite(preload=["sleep"], models={"known": {"sleep": {"max_inflight": 4}}})
    conn = Connection(server=suite.settings.gateway.edge.bind, client_id=f"dead-{uuid.uuid4().hex[:6]}")
    model = conn.model("sleep")
    try:
        for _ in range(12):  # four run on the worker, eight wait in the scheduler
            model.observe(ms=np.array([3000.0], dtype=np.float32))
        time.sleep(0.5)
        killed_at = _kill(suite, "model-pool")
        replies = _collect(model, 12, since=killed_at, bound_s=TTL_S + 1.5)
        assert all("error_code" in reply for reply in replies), replies
    finally:
        conn.close()


def test_requests_a_restarted_scheduler_never_saw_are_answered_when_their_worker_dies(
    make_suite,
) -> None:
    suite = make_suite(
        preload=["sleep"],
        models={"known": {"sleep": {"max_inflight": 4}}},
        scheduler={"request_ttl_ms": 60_000},  # long requests: the deadline is far away
    )
    conn = Connection(server=suite.settings.gateway.edge.bind, client_id=f"dead-{uuid.uuid4().hex[:6]}")
    model = conn.model("sleep")
    try:
        for _ in range(4):
            model.observe(ms=np.array([30_000.0], dtype=np.float32))
        time.sleep(0.5)  # all four run on the worker
        _kill(suite, "scheduler")
        suite.start_service("scheduler", timeout_s=60)
        suite.wait_for_models(["sleep"], timeout_s=30)  # the worker re-registered
        killed_at = _kill(suite, "model-pool")
        replies = _collect(model, 4, since=killed_at, bound_s=3.0)
        assert [reply.get("error_code") for reply in replies] == ["unavailable"] * 4, replies
    finally:
        conn.close()
