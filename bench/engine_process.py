"""Cold start of tiny-chat through an engine process against in-process: the time from a
request for an unloaded model to its first token.

    .venv/bin/python bench/engine_process.py [--repeat 3] [--warm 5]

Starts the real suite on free ports with nothing preloaded. For each of `tiny-chat`
(backend transformers: the worker loads the model into its own process) and
`tiny-chat-process` (backend openai_process: the worker starts `transformers serve` on the
same folder, polls its /health, and proxies), it sends a streaming chat completion to the
gateway's OpenAI endpoint while the model is IDLE and times the first content chunk (the
scheduler's Load, the lease, the engine's start and warm-up, then the first token), then
unloads it through the worker's gRPC `Unload`; `--repeat` times. The first cold start in the
fresh worker is reported apart: for in-process tiny-chat it also pays importing torch and
transformers into the worker, which an engine process pays on every start. Then `--warm`
requests to the loaded model give the warm time to first token for comparison.
Writes bench/results/engine_process.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
from _harness import EXAMPLE_CONFIG, write_result

from loadmaster.v1 import model_pool_pb2, model_pool_pb2_grpc

MODELS = {"tiny-chat": "in_process", "tiny-chat-process": "engine_process"}


def first_token_s(url: str, model: str) -> float:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    started = time.perf_counter()
    with httpx.stream("POST", url, json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                elapsed = time.perf_counter() - started
                response.close()
                return elapsed
    raise RuntimeError(f"{model}: no token in the reply")


def wait_idle(stub: model_pool_pb2_grpc.ModelPoolServiceStub, model: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = stub.Status(model_pool_pb2.StatusRequest(), timeout=5)
        state = next((m.state for m in status.models if m.model_id == model), None)
        if state == model_pool_pb2.MODEL_STATE_IDLE:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{model} did not unload")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warm", type=int, default=5)
    args = parser.parse_args()
    from loadmaster.cli.launcher import Suite, free_port_overrides

    overrides = free_port_overrides()
    overrides["model_pool"]["preload"] = []
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="loadmaster-bench-") as logs:
        suite = Suite(EXAMPLE_CONFIG, overrides=overrides, log_dir=Path(logs))
        suite.start(timeout_s=120)
        gateway = suite.settings.gateway
        url = f"http://{gateway.http_host}:{gateway.http_port}/v1/chat/completions"
        try:
            with grpc.insecure_channel(suite.settings.model_pool.address) as channel:
                stub = model_pool_pb2_grpc.ModelPoolServiceStub(channel)
                for model, kind in MODELS.items():
                    cold: list[float] = []
                    for attempt in range(args.repeat + 1):
                        wait_idle(stub, model)
                        seconds = first_token_s(url, model)
                        cold.append(seconds)
                        print(
                            f"{model} ({kind}) cold start {attempt + 1}: first token after {seconds * 1000:.0f} ms"
                        )
                        if attempt < args.repeat:
                            stub.Unload(model_pool_pb2.UnloadRequest(model_id=model), timeout=60)
                    warm = [first_token_s(url, model) for _ in range(args.warm)]
                    stub.Unload(model_pool_pb2.UnloadRequest(model_id=model), timeout=60)
                    results[kind] = {
                        "model": model,
                        "cold_first_in_fresh_worker_ms": round(cold[0] * 1000, 1),
                        "cold_ms": [round(s * 1000, 1) for s in cold[1:]],
                        "cold_median_ms": round(statistics.median(cold[1:]) * 1000, 1) if cold[1:] else None,
                        "warm_median_ms": round(statistics.median(warm) * 1000, 1) if warm else None,
                    }
                    print(
                        f"{model}: cold median {results[kind]['cold_median_ms']} ms, "
                        f"warm median {results[kind]['warm_median_ms']} ms"
                    )
        finally:
            suite.stop()
    inp, proc = results["in_process"], results["engine_process"]
    if inp["cold_median_ms"] and proc["cold_median_ms"]:
        results["engine_process_over_in_process_cold"] = round(
            proc["cold_median_ms"] / inp["cold_median_ms"], 2
        )
    path = write_result(
        "engine_process",
        {
            "device": "cpu",
            "engine": "transformers serve --continuous-batching (examples/models/tiny-chat-process)",
            "repeat": args.repeat,
            "results": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
