"""The scheduler with two real model-pool workers: placement, cold-load queueing, worker loss.

A suite of real processes (launcher `Suite`, workers=2) on free loopback ports; `sleep` is
preloaded on both workers with max_inflight 1 and latest_only, `double` on neither (it is
loaded on demand).
The stock Inferential client sends the requests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from inferential import Connection

from loadmaster.cli.launcher import Suite, free_port_overrides
from loadmaster.v1 import model_pool_pb2, model_pool_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = ROOT / "examples" / "loadmaster.yaml"
TIMEOUT_MS = 20_000


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    tmp = tmp_path_factory.mktemp("two-workers")
    data = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    data["models"]["repository"] = str((EXAMPLE_CONFIG.parent / data["models"]["repository"]).resolve())
    data["models"]["known"]["sleep"] = {"max_inflight": 1, "vram_mb": 16, "latest_only": True}
    data["model_pool"]["preload"] = ["sleep"]
    data["scheduler"]["max_retries"] = 2
    config = tmp / "loadmaster.yaml"
    config.write_text(yaml.safe_dump(data))
    suite = Suite(config, overrides=free_port_overrides(), log_dir=tmp / "logs", workers=2)
    suite.start(timeout_s=120)
    try:
        _wait_workers(suite, 2, {"sleep"})
        yield suite
    finally:
        suite.stop()
        for log in sorted((tmp / "logs").glob("*.log")):
            print(f"---- {log.name} (tail) ----\n" + "\n".join(log.read_text().splitlines()[-20:]))


def _workers(suite: Suite) -> list[scheduler_pb2.WorkerInfo]:
    with grpc.insecure_channel(suite.settings.scheduler.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        return list(stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5).workers)


def _ready(worker: scheduler_pb2.WorkerInfo) -> set[str]:
    return {m.model_id for m in worker.models if m.state == model_pool_pb2.MODEL_STATE_READY}


def _wait_workers(
    suite: Suite, count: int, ready: set[str], timeout_s: float = 60.0
) -> list[scheduler_pb2.WorkerInfo]:
    deadline = time.monotonic() + timeout_s
    while True:
        workers = _workers(suite)
        if len(workers) == count and all(ready <= _ready(w) for w in workers):
            return workers
        assert time.monotonic() < deadline, f"workers not ready: {workers}"
        time.sleep(0.1)


def _status(worker: scheduler_pb2.WorkerInfo) -> model_pool_pb2.StatusResponse:
    with grpc.insecure_channel(worker.grpc_endpoint) as channel:
        return model_pool_pb2_grpc.ModelPoolServiceStub(channel).Status(
            model_pool_pb2.StatusRequest(), timeout=5
        )


def _last_used(worker: scheduler_pb2.WorkerInfo, model_id: str) -> int:
    return next((m.last_used_unix_ms for m in _status(worker).models if m.model_id == model_id), 0)


def _conn(suite: Suite) -> Connection:
    return Connection(server=suite.settings.gateway.edge.bind, client_id=f"e2e-{uuid.uuid4().hex[:8]}")


def test_concurrent_requests_are_placed_on_both_workers(two_workers: Suite) -> None:
    workers = _wait_workers(two_workers, 2, {"sleep"})
    started_ms = int(time.time() * 1000)
    conns = [_conn(two_workers) for _ in range(2)]
    try:
        models = [c.model("sleep") for c in conns]
        for m in models:  # max_inflight 1 per worker: the second goes to the other worker
            m.observe(ms=np.array([300.0], dtype=np.float32))
        for m in models:
            result = m.get_result(timeout_ms=TIMEOUT_MS)
            assert result is not None and "error" not in result, result
    finally:
        for c in conns:
            c.close()
    used = [_last_used(w, "sleep") for w in workers]
    assert all(u >= started_ms for u in used), f"not both workers ran sleep: {used}"


def test_cold_model_is_loaded_on_demand_and_requests_wait_for_it(two_workers: Suite) -> None:
    assert not any("double" in _ready(w) for w in _workers(two_workers))
    conn = _conn(two_workers)
    try:
        model = conn.model("double")
        x = np.arange(5, dtype=np.float32)
        for _ in range(3):  # queued behind the load (the VRAM gate), none fails
            model.observe(x=x)
        for _ in range(3):
            result = model.get_result(timeout_ms=TIMEOUT_MS)
            assert result is not None and "error" not in result, result
            np.testing.assert_array_equal(result["x"], x * 2)
    finally:
        conn.close()
    holders = [w.worker_id for w in _workers(two_workers) if "double" in _ready(w)]
    assert len(holders) == 1, holders  # one Load command, on one worker


def _codes(model: object, count: int) -> list[str]:
    codes = []
    for _ in range(count):
        result = model.get_result(timeout_ms=TIMEOUT_MS)  # type: ignore[attr-defined]
        assert result is not None, "no reply"
        codes.append(str(result.get("error_code", "ok")) if "error" in result else "ok")
    return codes


def _wait_busy(workers: list[scheduler_pb2.WorkerInfo], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(any(m.model_id == "sleep" and m.inflight for m in _status(w).models) for w in workers):
        assert time.monotonic() < deadline, "sleep is not running on both workers"
        time.sleep(0.02)


def test_latest_only_supersedes_and_timeout_expires_through_the_suite(two_workers: Suite) -> None:
    workers = _wait_workers(two_workers, 2, {"sleep"})
    conn = _conn(two_workers)
    try:
        model = conn.model("sleep")
        for _ in range(2):  # two run, one per worker
            model.observe(ms=np.array([600.0], dtype=np.float32))
        _wait_busy(workers)
        for _ in range(2):  # the 3rd waits, the 4th supersedes it
            model.observe(ms=np.array([400.0], dtype=np.float32))
        assert sorted(_codes(model, 4)) == ["ok", "ok", "ok", "superseded"]
        for _ in range(2):  # keep both workers busy...
            model.observe(ms=np.array([600.0], dtype=np.float32))
        _wait_busy(workers)
        other = _conn(two_workers)
        try:  # ...while another client's request with a 50 ms timeout waits and expires
            short = other.model("sleep")
            short.observe(ms=np.array([1.0], dtype=np.float32), timeout_ms="50")
            assert _codes(short, 1) == ["expired"]
        finally:
            other.close()
        assert _codes(model, 2) == ["ok", "ok"]
    finally:
        conn.close()


# Two strategies in make test, all six in make test-all: each case is a CLI switch and a few
# calls (1.2 s); services/scheduler/tests/unit/test_strategies.py checks each one's order.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "strategy",
    [
        "deadline_aware",
        pytest.param("tiered_deadline", marks=_SLOW),
        pytest.param("batch_optimized", marks=_SLOW),
        pytest.param("priority_tiered", marks=_SLOW),
        "round_robin",
        pytest.param("model_deadline", marks=_SLOW),
    ],
)
def test_every_strategy_serves_through_the_suite(two_workers: Suite, strategy: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadmaster.cli.main",
            "scheduler",
            "use",
            strategy,
            "--address",
            two_workers.settings.scheduler.address,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert f"-> {strategy}" in done.stdout
    conns = [_conn(two_workers) for _ in range(3)]
    try:
        models = [c.model("sleep", priority=i) for i, c in enumerate(conns)]
        for m in models:
            m.observe(ms=np.array([20.0], dtype=np.float32))
        assert [_codes(m, 1)[0] for m in models] == ["ok", "ok", "ok"]
    finally:
        for c in conns:
            c.close()


def test_worker_loss_requeues_its_grant_on_the_other_worker(two_workers: Suite) -> None:
    workers = _wait_workers(two_workers, 2, {"sleep"})
    conn = _conn(two_workers)
    try:
        model = conn.model("sleep")
        model.observe(ms=np.array([1500.0], dtype=np.float32))
        # find the worker running it, then kill that worker's process group outright
        deadline = time.monotonic() + 10
        victim = None
        while victim is None:
            for w in workers:
                if any(m.model_id == "sleep" and m.inflight for m in _status(w).models):
                    victim = w
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
        process = next(
            p
            for p in two_workers.processes
            if p.name.startswith("model-pool") and p.address == victim.grpc_endpoint
        )
        os.killpg(process.process.pid, signal.SIGKILL)
        result = model.get_result(timeout_ms=TIMEOUT_MS)
        assert result is not None, "no reply after the worker died"
        assert "error" not in result, result  # re-granted to the surviving worker (attempt 2)
        survivors = _workers(two_workers)
        assert [w.worker_id for w in survivors] == [
            w.worker_id for w in workers if w.worker_id != victim.worker_id
        ]
    finally:
        conn.close()
