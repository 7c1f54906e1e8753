"""Drains across SIGTERM, with real processes and stock clients (issue 26).

Requests in flight (the `sleep` model, 1.5 s) when a gateway, a worker or `loadmaster up`
gets SIGTERM all succeed; a draining gateway answers new requests `unavailable` on every
front end (HTTP 503, gRPC UNAVAILABLE, the edge's error reply) and its /readyz 503 at once;
`up` stops the services in dependency order and exits 0.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from loadmaster.cli.launcher import Suite, free_port_overrides, to_env
from loadmaster.client import Connection
from loadmaster.common.errors import UnavailableError
from loadmaster.v1 import model_pool_pb2, model_pool_pb2_grpc

pytestmark = pytest.mark.slow  # a suite of its own, and `loadmaster up` once more (~60 s)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "loadmaster.yaml"
SLEEP_MS = 1500.0
IN_FLIGHT = 6


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    overrides = free_port_overrides()
    overrides["model_pool"]["preload"] = ["sleep"]
    # Three at once on each of the two workers: all the requests run together.
    overrides["model_pool"]["inference_threads"] = 3
    overrides["models"] = {"defaults": {"instances": 3}}
    for section in ("gateway", "model_pool"):
        overrides[section]["shutdown_grace_s"] = 10
    log_dir = tmp_path_factory.mktemp("drain-suite")
    running = Suite(CONFIG, overrides=overrides, log_dir=log_dir, workers=2)
    running.start(timeout_s=120)
    try:
        running.wait_for_models(["sleep"], timeout_s=120)
        yield running
    finally:
        running.stop()
        for log in sorted(log_dir.glob("*.log")):
            print(f"---- {log.name} (tail) ----\n" + "\n".join(log.read_text().splitlines()[-20:]))


def _http_base(settings: Any) -> str:
    return f"http://{settings.gateway.http_host}:{settings.gateway.http_port}"


def _send_sleeps(
    pool: ThreadPoolExecutor, http_url: str, grpc_address: str, edge: str, count: int
) -> list[Future[float]]:
    """`count` sleep requests over HTTP, gRPC and the edge in turn, each with its stock client."""

    def over_http() -> float:
        client = triton_http.InferenceServerClient(http_url.removeprefix("http://"), network_timeout=30)
        tensor = triton_http.InferInput("ms", [1], "FP32")
        tensor.set_data_from_numpy(np.array([SLEEP_MS], np.float32))
        result = client.infer("sleep", [tensor])
        return float(result.as_numpy("ms")[0])

    def over_grpc() -> float:
        client = triton_grpc.InferenceServerClient(grpc_address)
        tensor = triton_grpc.InferInput("ms", [1], "FP32")
        tensor.set_data_from_numpy(np.array([SLEEP_MS], np.float32))
        result = client.infer("sleep", [tensor], client_timeout=30)
        client.close()
        return float(result.as_numpy("ms")[0])

    def over_edge() -> float:
        with Connection(edge) as conn:
            out = conn.model("sleep").infer(ms=np.array([SLEEP_MS], np.float32), timeout_ms=20_000)
        return float(out["ms"][0])

    kinds = (over_http, over_grpc, over_edge)
    return [pool.submit(kinds[i % len(kinds)]) for i in range(count)]


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


def _gateway_inflight(http_url: str) -> int:
    try:
        return int(httpx.get(f"{http_url}/healthz", timeout=2).json()["inflight"])
    except (httpx.HTTPError, ValueError, KeyError):
        return -1


def _worker_inflight(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = model_pool_pb2_grpc.ModelPoolServiceStub(channel).Status(
            model_pool_pb2.StatusRequest(), timeout=5
        )
    return sum(m.inflight for m in reply.models)


def test_a_gateway_finishes_its_requests_in_flight_and_refuses_new_ones(suite: Suite) -> None:
    settings = suite.settings
    http_url = _http_base(settings)
    gateway = suite.service("gateway")
    assert gateway is not None
    streamed: queue.Queue[Any] = queue.Queue()
    stream = triton_grpc.InferenceServerClient(settings.gateway.address)
    stream.start_stream(callback=lambda result, error: streamed.put(error or result))
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        futures = _send_sleeps(
            pool, http_url, settings.gateway.address, settings.gateway.edge.bind, IN_FLIGHT
        )
        # And one on a ModelStreamInfer stream that the client keeps open afterwards.
        on_stream = triton_grpc.InferInput("ms", [1], "FP32")
        on_stream.set_data_from_numpy(np.array([SLEEP_MS], np.float32))
        stream.async_stream_infer("sleep", [on_stream])
        _wait_for(lambda: _gateway_inflight(http_url) == IN_FLIGHT + 1, "requests in flight at the gateway")
        os.killpg(gateway.process.pid, signal.SIGTERM)
        signalled = time.monotonic()
        _wait_for(lambda: httpx.get(f"{http_url}/readyz", timeout=2).status_code == 503, "readyz 503")
        with grpc.insecure_channel(settings.gateway.address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        # New work is refused, clearly, on every front end, while the old work goes on.
        refused = httpx.post(
            f"{http_url}/v2/models/sleep/infer",
            json={"inputs": [{"name": "ms", "shape": [1], "datatype": "FP32", "data": [1.0]}]},
            timeout=5,
        )
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]
        client = triton_grpc.InferenceServerClient(settings.gateway.address)
        tensor = triton_grpc.InferInput("ms", [1], "FP32")
        tensor.set_data_from_numpy(np.array([1.0], np.float32))
        with pytest.raises(InferenceServerException) as caught:
            client.infer("sleep", [tensor], client_timeout=5)
        client.close()
        assert caught.value.status() in ("StatusCode.UNAVAILABLE",), caught.value
        with Connection(settings.gateway.edge.bind) as conn, pytest.raises(UnavailableError):
            conn.model("sleep").infer(ms=np.array([1.0], np.float32), timeout_ms=5000)
        answers = [future.result(timeout=30) for future in futures]
    assert answers == [SLEEP_MS] * IN_FLIGHT
    streamed_result = streamed.get(timeout=30)
    assert float(streamed_result.as_numpy("ms")[0]) == SLEEP_MS, streamed_result
    assert gateway.process.wait(timeout=15) == 0
    # The idle stream (still open on the client's side) did not hold the stop for the 10 s grace.
    assert time.monotonic() - signalled < 8.0
    stream.stop_stream()
    stream.close()
    suite.restart("gateway", timeout_s=60)


def test_a_worker_finishes_its_requests_in_flight(suite: Suite) -> None:
    settings = suite.settings
    http_url = _http_base(settings)
    worker = suite.service("model-pool-1")
    assert worker is not None
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        futures = _send_sleeps(
            pool, http_url, settings.gateway.address, settings.gateway.edge.bind, IN_FLIGHT
        )
        _wait_for(
            lambda: _worker_inflight(worker.address) > 0,
            "requests running on the worker to stop",
        )
        os.killpg(worker.process.pid, signal.SIGTERM)
        answers = [future.result(timeout=30) for future in futures]
    assert answers == [SLEEP_MS] * IN_FLIGHT
    assert worker.process.wait(timeout=15) == 0
    lines = worker.log_tail(500).lower().splitlines()
    assert not [line for line in lines if "lease" in line and "fail" in line], lines
    suite.restart("model-pool-1", timeout_s=60)


def test_up_stops_in_dependency_order_after_its_requests_in_flight(tmp_path: Path) -> None:
    """`loadmaster up` with no config file (built-in defaults, the example models through the
    environment), SIGTERM with requests in flight: they all succeed, the services stop gateway
    first and Redis last, and `up` exits 0."""
    overrides = free_port_overrides()
    overrides["models"] = {
        "repository": str(ROOT / "examples" / "models"),
        # all of them run at once on the one worker
        "defaults": {"max_inflight": IN_FLIGHT, "instances": IN_FLIGHT},
    }
    overrides["model_pool"]["inference_threads"] = IN_FLIGHT
    overrides["model_pool"]["preload"] = ["sleep"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOADMASTER_") and k != "REDIS_URL"}
    env.update(to_env(overrides))
    env["COLUMNS"] = "200"
    up = subprocess.Popen(
        [sys.executable, "-m", "loadmaster.cli.main", "up", "--json"],
        cwd=tmp_path,  # no loadmaster.yaml here
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    http_url = f"http://127.0.0.1:{overrides['gateway']['http_port']}"
    try:
        assert up.stdout is not None
        started = json.loads(up.stdout.readline())  # printed once every service is healthy
        assert started["endpoints"]["gateway gRPC"] == overrides["gateway"]["address"]
        _wait_for(lambda: httpx.get(f"{http_url}/readyz", timeout=2).status_code == 200, "sleep READY", 60)
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            futures = _send_sleeps(
                pool,
                http_url,
                overrides["gateway"]["address"],
                overrides["gateway"]["edge"]["bind"],
                IN_FLIGHT,
            )
            _wait_for(lambda: _gateway_inflight(http_url) == IN_FLIGHT, "requests in flight")
            up.send_signal(signal.SIGTERM)
            answers = [future.result(timeout=30) for future in futures]
        assert answers == [SLEEP_MS] * IN_FLIGHT
        _, stderr = up.communicate(timeout=120)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    assert up.returncode == 0, stderr
    order = [
        line.split()[0]
        for line in stderr.splitlines()
        if (line.endswith(" s)") and " stopped (" in line) or line == "redis stopped"
    ]
    assert order == ["gateway", "model-pool", "scheduler", "gpu-broker", "metrics", "redis"], stderr
    assert "failed" not in stderr.lower(), stderr
