"""Priority holds across gateways: a priority-0 control loop on one gateway is served ahead of
the priority-2 clients that saturate the same model through another gateway.

Real processes: a suite on free loopback ports plus a second gateway of it (the launcher's
`start_service("gateway", index=1)`), model `sleep` at 10 ms per call with 2 slots and 2
instances. Six closed-loop priority-2 clients on gateway B keep a queue waiting; one priority-0
client on gateway A sends a call every 50 ms. Served in arrival order, the priority-0 calls
would wait as long as the others; ahead of them, each waits only for the first slot to free.
The numbers (two gateways against one) come from bench/two_gateway_priority.py.

On a short model (`double`, 4 slots) the two gateways split the slots instead, each ordering
its own calls (docs/data-path.md "Shares between gateways"); bench/shared_model.py has the numbers.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from inferential import Connection

from loadmaster.cli.launcher import Suite, free_port_overrides

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = ROOT / "examples" / "loadmaster.yaml"
SLEEP_MS = np.array([10.0], dtype=np.float32)
LOW_CLIENTS = 6
SECONDS = 3.0
DOUBLE_SLOTS = 4
Gateways = tuple[tuple[str, str], tuple[str, str]]  # (edge, /healthz URL) of A and of B


@pytest.fixture(scope="module")
def two_gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateways]:
    logs = tmp_path_factory.mktemp("two-gateways")
    overrides = free_port_overrides()
    overrides["model_pool"]["preload"] = ["sleep", "double"]
    overrides["models"] = {
        "known": {
            "sleep": {"max_inflight": 2, "instances": 2, "vram_mb": 16},
            "double": {"max_inflight": DOUBLE_SLOTS},
        }
    }
    suite = Suite(EXAMPLE_CONFIG, overrides=overrides, log_dir=logs)
    suite.start(timeout_s=120)
    try:
        suite.wait_for_models(["sleep", "double"], timeout_s=120)
        second = suite.start_service("gateway", index=1, timeout_s=120).overrides["gateway"]
        gw = suite.settings.gateway
        yield (
            (gw.edge.bind, f"http://127.0.0.1:{gw.http_port}/healthz"),
            (second["edge"]["bind"], f"http://127.0.0.1:{second['http_port']}/healthz"),
        )
    finally:
        suite.stop()
        for log in sorted(logs.glob("*.log")):
            print(f"---- {log.name} (tail) ----\n" + "\n".join(log.read_text().splitlines()[-20:]))


def _calls(
    edge: str, priority: int, period_s: float | None, until: float, out: list[float], errors: list[str]
) -> None:
    """Calls to `sleep` until `until` (monotonic), one per `period_s` or back to back; each
    call's latency into `out`."""
    conn = Connection(server=edge, client_id=f"p{priority}-{uuid.uuid4().hex[:6]}")
    try:
        model = conn.model("sleep", priority=priority)
        next_send = time.monotonic()
        while (now := time.monotonic()) < until:
            if period_s is not None:
                if next_send > now:
                    time.sleep(next_send - now)
                next_send += period_s
            sent = time.monotonic()
            model.observe(ms=SLEEP_MS, priority=priority)
            result = model.get_result(timeout_ms=10_000)
            if result is None or "error" in result:
                errors.append("no reply" if result is None else str(result.get("error")))
                continue
            out.append(time.monotonic() - sent)
    finally:
        conn.close()


def test_a_priority_0_loop_on_one_gateway_goes_ahead_of_saturation_through_another(
    two_gateways: Gateways,
) -> None:
    (edge_a, _), (edge_b, _) = two_gateways
    high: list[float] = []
    low: list[float] = []
    errors: list[str] = []
    until = time.monotonic() + 1.0 + SECONDS  # the first second warms the clients up
    threads = [
        threading.Thread(target=_calls, args=(edge_b, 2, None, until, low, errors))
        for _ in range(LOW_CLIENTS)
    ]
    threads.append(threading.Thread(target=_calls, args=(edge_a, 0, 0.05, until, high, errors)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=SECONDS + 30)
    assert not any(thread.is_alive() for thread in threads), "a client did not finish"
    assert errors == []
    assert len(high) >= 20 and len(low) >= 50, (len(high), len(low))
    high_ms, low_ms = np.median(high) * 1000, np.median(low) * 1000
    print(f"median latency: priority 0 on A {high_ms:.1f} ms, priority 2 on B {low_ms:.1f} ms")
    # Served in arrival order the two would be about equal (the queue B's clients keep).
    assert high_ms < 0.8 * low_ms, f"priority 0 {high_ms:.1f} ms, priority 2 {low_ms:.1f} ms"


def _double_calls(edge: str, until: float, done: list[int], errors: list[str]) -> None:
    """Calls to `double`, back to back, until `until` (monotonic)."""
    conn = Connection(server=edge, client_id=f"d-{uuid.uuid4().hex[:6]}")
    x = np.arange(7, dtype=np.float32)
    calls = 0
    try:
        model = conn.model("double")
        while time.monotonic() < until:
            model.observe(x=x)
            result = model.get_result(timeout_ms=10_000)
            if result is None or "error" in result:
                errors.append("no reply" if result is None else str(result.get("error")))
                continue
            calls += 1
    finally:
        conn.close()
        done.append(calls)


def _credits(http: httpx.Client, url: str) -> int:
    return int(http.get(url, timeout=5.0).json().get("shares", {}).get("double", {}).get("credits", 0))


def test_two_busy_gateways_split_a_short_models_slots_and_never_overcommit(two_gateways: Gateways) -> None:
    (edge_a, url_a), (edge_b, url_b) = two_gateways
    done: list[int] = []
    errors: list[str] = []
    until = time.monotonic() + 1.0 + SECONDS
    threads = [
        threading.Thread(target=_double_calls, args=(edge, until, done, errors))
        for edge in (edge_a, edge_a, edge_a, edge_b, edge_b, edge_b)
    ]
    for thread in threads:
        thread.start()
    samples: list[tuple[int, int]] = []
    with httpx.Client() as http:
        while time.monotonic() < until - 0.2:  # bounded by `until`
            samples.append((_credits(http, url_a), _credits(http, url_b)))
            time.sleep(0.05)
    for thread in threads:
        thread.join(timeout=SECONDS + 30)
    assert not any(thread.is_alive() for thread in threads), "a client did not finish"
    assert errors == []
    assert len(done) == 6 and min(done) >= 50, done
    assert all(a + b <= DOUBLE_SLOTS for a, b in samples), samples  # a slot is lent once at most
    split = sum(1 for a, b in samples if a and b)
    print(f"both gateways held credits in {split} of {len(samples)} samples; calls per client {done}")
    assert split >= len(samples) // 2, samples  # each orders its own calls on its part
