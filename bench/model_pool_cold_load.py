"""Cold-load times: how long a worker takes from Load to READY (lease, read, place, warm-up).

    .venv/bin/python bench/model_pool_cold_load.py [--models policy classifier policy-onnx] [--repeat 3]

Starts the real suite on free ports with nothing preloaded, then for each model calls
the worker's gRPC `Load` (the first load of a backend in a fresh worker also imports
it: torch takes seconds), `Unload`, and `Load` again `--repeat` times; the times are
the worker's own `load_time_ms` (LOADING -> READY, lease and warm-up included) and the
caller's wall time. Writes bench/results/model_pool_cold_load.json.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from _harness import EXAMPLE_CONFIG, write_result

from loadmaster.v1 import model_pool_pb2, model_pool_pb2_grpc


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["policy", "classifier", "policy-onnx"])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from loadmaster.cli.launcher import Suite, free_port_overrides

    overrides = free_port_overrides()
    overrides["model_pool"]["preload"] = []
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="loadmaster-bench-") as logs:
        suite = Suite(EXAMPLE_CONFIG, overrides=overrides, log_dir=Path(logs))
        suite.start(timeout_s=120)
        try:
            with grpc.insecure_channel(suite.settings.model_pool.address) as channel:
                stub = model_pool_pb2_grpc.ModelPoolServiceStub(channel)
                for model in args.models:
                    runs = []
                    for attempt in range(args.repeat + 1):
                        started = time.perf_counter()
                        reply = stub.Load(model_pool_pb2.LoadRequest(model_id=model), timeout=300)
                        wall_ms = (time.perf_counter() - started) * 1000
                        runs.append(
                            {"load_time_ms": round(reply.model.load_time_ms, 1), "wall_ms": round(wall_ms, 1)}
                        )
                        stub.Unload(model_pool_pb2.UnloadRequest(model_id=model), timeout=60)
                        print(
                            f"{model} load {attempt + 1}: {reply.model.load_time_ms:.0f} ms (wall {wall_ms:.0f} ms)"
                        )
                    results[model] = {
                        "first_in_fresh_worker": runs[0],
                        "reloads": runs[1:],
                        "reload_best_ms": min(r["load_time_ms"] for r in runs[1:]) if runs[1:] else None,
                    }
        finally:
            suite.stop()
    path = write_result("model_pool_cold_load", {"models": results, "device": "cpu"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
