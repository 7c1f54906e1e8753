"""Issue 21's whole path on one declared GPU: the `openai` client asks for an alias, an engine
process (`transformers serve` on tiny-chat) that the worker started under a GPU lease answers,
and when another model needs that memory the engine is stopped and its lease released.

One declared GPU of 1,000 MB: the engine model is booked at 600 MB and `big` needs 800 MB, so
`big` can only load once the engine is gone. The broker's books are read after each step."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import psutil
import pytest
import tritonclient.http as triton

from loadmaster.cli.launcher import Suite, free_port_overrides

pytestmark = pytest.mark.slow  # the engine's cold start (~10-20 s on CPU)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "models"
EXAMPLE_CONFIG = ROOT / "examples" / "loadmaster.yaml"
ENGINE_MODEL = "tiny-chat-process"
ALIAS = "engine-chat"
BIG = """
import numpy as np

class Big:
    def infer(self, inputs):
        return {"y": inputs["x"] * np.float32(2)}
"""


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    repo = tmp_path_factory.mktemp("alias-models")
    for name in ("tiny-chat", ENGINE_MODEL):  # the engine's config points at ../tiny-chat/artifacts
        (repo / name).symlink_to(EXAMPLES / name, target_is_directory=True)
    (repo / "big").mkdir()
    (repo / "big" / "config.yaml").write_text(
        "backend: python\nclass: Big\ninputs:\n  - {name: x, dtype: float32}\n"
        "outputs:\n  - {name: y, dtype: float32}\n"
    )
    (repo / "big" / "model.py").write_text(BIG)
    overrides = free_port_overrides()
    overrides["gpu_broker"].update(
        {"reserve_mb": 0, "declared": {"local": [{"index": 0, "total_mb": 1000, "name": "declared"}]}}
    )
    overrides["model_pool"].update({"preload": [], "eviction_wait_s": 1})
    overrides["scheduler"] = {**overrides["scheduler"], "request_ttl_ms": 120_000, "vram_gate_retry_ms": 300}
    overrides["models"] = {
        "repository": str(repo),
        "defaults": {"min_resident_s": 0},
        "known": {
            ENGINE_MODEL: {"vram_mb": 600, "max_inflight": 4, "dispatch_credits": 0, "lookahead": 0},
            "big": {"vram_mb": 800, "priority": 2},  # may evict the engine (priority 1)
        },
        "aliases": {ALIAS: {"models": [ENGINE_MODEL]}},
    }
    log_dir = tmp_path_factory.mktemp("alias-logs")
    suite = Suite(EXAMPLE_CONFIG, overrides=overrides, log_dir=log_dir)
    suite.start(timeout_s=120)
    try:
        yield suite
    finally:
        suite.stop()
        for log in sorted(log_dir.glob("model-pool*.log")):
            print(f"---- {log.name} (tail) ----\n" + "\n".join(log.read_text().splitlines()[-30:]))


def engines(worker_pid: int) -> list[psutil.Process]:
    return [
        c for c in psutil.Process(worker_pid).children(recursive=True) if "serve" in " ".join(c.cmdline())
    ]


def leased_models(suite: Suite) -> list[str]:
    import grpc

    from loadmaster.v1 import gpu_broker_pb2, gpu_broker_pb2_grpc

    with grpc.insecure_channel(suite.settings.gpu_broker.address) as channel:
        stub = gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel)
        leases = stub.ListLeases(gpu_broker_pb2.ListLeasesRequest(), timeout=5).leases
    return sorted(lease.labels["model"] for lease in leases)


def test_an_alias_is_answered_by_an_engine_process_that_gives_its_memory_back(one_gpu: Suite) -> None:
    gateway = one_gpu.settings.gateway
    client = openai.OpenAI(
        base_url=f"http://{gateway.http_host}:{gateway.http_port}/v1",
        api_key="none",
        max_retries=0,
        timeout=180,
    )
    raw = client.chat.completions.with_raw_response.create(
        model=ALIAS, messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0
    )
    reply = raw.parse()
    assert reply.model == ENGINE_MODEL and raw.headers["x-loadmaster-model"] == ENGINE_MODEL
    assert reply.choices[0].message.content
    assert leased_models(one_gpu) == [ENGINE_MODEL]
    worker = one_gpu.service("model-pool")
    assert worker is not None
    (engine,) = engines(worker.process.pid)

    # `big` needs 800 of the 1,000 MB: the idle engine must go, and its lease with it.
    http = triton.InferenceServerClient(f"{gateway.http_host}:{gateway.http_port}", network_timeout=120)
    x = triton.InferInput("x", [3], "FP32")
    x.set_data_from_numpy(np.array([1, 2, 3], dtype=np.float32))
    result = http.infer("big", [x])
    assert result.as_numpy("y").tolist() == [2, 4, 6]

    deadline = time.monotonic() + 15
    while engine.is_running() and engine.status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the evicted engine process is still running"
        time.sleep(0.05)
    assert leased_models(one_gpu) == ["big"]  # the engine's 600 MB were released, never promised twice
