"""Eviction under real traffic: one declared GPU x 1000 MB, three 400 MB models, one of them pinned.

Only two models fit at a time. Three stock Inferential clients send alternating
traffic (a, b, c, a, b, c, ... each starting elsewhere), so the worker keeps evicting
one model to load another. Every request must be answered, correctly; the pinned
model is never evicted; models are evicted only when idle (a request cut off by an
eviction would come back as an error or a wrong value).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from inferential import Connection

from loadmaster.cli.launcher import Suite, free_port_overrides
from loadmaster.v1 import model_pool_pb2, model_pool_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = ROOT / "examples" / "loadmaster.yaml"
FACTORS = {"a": 2.0, "b": 3.0, "c": 5.0}
MODEL = """
import time
import numpy as np

class Scale:
    def infer(self, inputs):
        time.sleep(float(inputs["ms"].reshape(())) / 1000.0)
        return {{"y": inputs["x"] * np.float32({factor})}}
"""
CLIENTS = 3
ROUNDS = 5  # per client, over the three models: 45 requests
TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def small_gpu_suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    repo = tmp_path_factory.mktemp("eviction-models")
    for name, factor in FACTORS.items():
        (repo / name).mkdir()
        (repo / name / "config.yaml").write_text(
            "backend: python\nclass: Scale\n"
            "inputs:\n  - {name: x, dtype: float32}\n  - {name: ms, dtype: float32}\n"
        )
        (repo / name / "model.py").write_text(MODEL.format(factor=factor))
    overrides = free_port_overrides()
    overrides["gpu_broker"].update(
        {"reserve_mb": 0, "declared": {"local": [{"index": 0, "total_mb": 1000, "name": "declared"}]}}
    )
    overrides["model_pool"].update({"preload": ["a"], "eviction_wait_s": 20})
    overrides["scheduler"] = {**overrides["scheduler"], "request_ttl_ms": 60_000, "max_retries": 10}
    overrides["models"] = {
        "repository": str(repo),
        "defaults": {"min_resident_s": 0.2, "max_inflight": 2},
        "known": {
            "a": {"vram_mb": 400, "pin": True},
            "b": {"vram_mb": 400},
            "c": {"vram_mb": 400},
        },
    }
    log_dir = tmp_path_factory.mktemp("eviction-logs")
    suite = Suite(EXAMPLE_CONFIG, overrides=overrides, log_dir=log_dir)
    suite.start(timeout_s=120)
    try:
        suite.wait_for_models(["a"], timeout_s=60)
        yield suite
    finally:
        suite.stop()
        for log in sorted(log_dir.glob("model-pool*.log")):
            print(f"---- {log.name} (tail) ----\n" + "\n".join(log.read_text().splitlines()[-40:]))


def _status(suite: Suite) -> model_pool_pb2.StatusResponse:
    with grpc.insecure_channel(suite.settings.model_pool.address) as channel:
        stub = model_pool_pb2_grpc.ModelPoolServiceStub(channel)
        return stub.Status(model_pool_pb2.StatusRequest(), timeout=5)


def _traffic(edge: str, index: int, answers: list[tuple[str, float, object]]) -> None:
    order = list(FACTORS)
    conn = Connection(server=edge, client_id=f"eviction-{index}")
    try:
        models = {name: conn.model(name) for name in order}
        for step in range(ROUNDS * len(order)):
            name = order[(index + step) % len(order)]
            value = float(index * 100 + step)
            models[name].observe(
                x=np.array([value], dtype=np.float32),
                ms=np.array([20.0 if step % 2 else 0.0], dtype=np.float32),
            )
            answers.append((name, value, models[name].get_result(timeout_ms=TIMEOUT_MS)))
    finally:
        conn.close()


# Slow (make test-all): test_eviction.py checks the choice of model without a suite.
@pytest.mark.slow
def test_alternating_traffic_evicts_only_idle_unpinned_models_and_loses_nothing(
    small_gpu_suite: Suite,
) -> None:
    edge = small_gpu_suite.settings.gateway.edge.bind
    answers: list[list[tuple[str, float, object]]] = [[] for _ in range(CLIENTS)]
    threads = [threading.Thread(target=_traffic, args=(edge, i, answers[i])) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=240)
    assert not any(thread.is_alive() for thread in threads), "clients still waiting for replies"

    flat = [answer for per_client in answers for answer in per_client]
    assert len(flat) == CLIENTS * ROUNDS * len(FACTORS)
    for name, value, result in flat:
        assert result is not None, f"no reply from {name} for {value}"
        assert isinstance(result, dict) and "error" not in result, result
        np.testing.assert_array_equal(result["y"], np.array([value * FACTORS[name]], dtype=np.float32))

    status = _status(small_gpu_suite)
    slots = {m.model_id: m for m in status.models}
    assert status.evictions["capacity"] > 0, "three 400 MB models on 1000 MB must evict"
    assert slots["a"].pinned and slots["a"].evictions == 0 and slots["a"].generation == 1
    assert slots["a"].state == model_pool_pb2.MODEL_STATE_READY
    assert slots["b"].evictions + slots["c"].evictions == status.evictions["capacity"]
    assert sum(status.leased_mb_per_gpu.values()) <= 1000
