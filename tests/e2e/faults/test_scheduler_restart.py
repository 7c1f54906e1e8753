"""Kill and restart the scheduler: meanwhile the gateway serves on its last shares (dispatch
credits) and answers `unavailable` within 1 s what they cannot serve; it reconnects by itself
and serves again without being restarted."""

from __future__ import annotations

import os
import signal
import time
import uuid

import numpy as np
import pytest
from inferential import Connection

pytestmark = pytest.mark.slow


def _ask(model, value: float) -> dict:
    model.observe(x=np.array([value], dtype=np.float32))
    result = model.get_result(timeout_ms=3000)
    assert result is not None, "no reply"
    return result


def test_gateway_survives_a_scheduler_restart(make_suite) -> None:
    suite = make_suite(preload=["double"])
    conn = Connection(server=suite.settings.gateway.edge.bind, client_id=f"c-{uuid.uuid4().hex[:6]}")
    model = conn.model("double")
    gateway = suite.service("gateway")
    try:
        assert _ask(model, 1.0)["x"][0] == 2.0

        scheduler = suite.service("scheduler")
        assert scheduler is not None and gateway is not None
        os.kill(scheduler.process.pid, signal.SIGKILL)
        scheduler.process.wait(5)
        killed_at = time.monotonic()
        time.sleep(0.2)
        started = time.monotonic()
        down = _ask(model, 2.0)  # served on the gateway's last share (docs/deploy.md, "Scheduler failover")
        assert down["x"][0] == 4.0, down
        unshared = conn.model("echo")  # no share of this one: nothing can serve it meanwhile
        down = _ask(unshared, 2.0)
        assert down.get("error_code") == "unavailable", down
        assert time.monotonic() - started < 1.0
        assert time.monotonic() - killed_at < 1.5

        suite.start_service("scheduler", timeout_s=60)
        suite.wait_for_models(["double"], timeout_s=30)  # the worker re-registered by itself
        deadline = time.monotonic() + 10
        result = _ask(model, 3.0)
        while "error_code" in result and time.monotonic() < deadline:
            time.sleep(0.1)
            result = _ask(model, 3.0)
        assert "error_code" not in result, result
        assert result["x"][0] == 6.0
        assert gateway.process.poll() is None, "the gateway was restarted"
    finally:
        conn.close()
