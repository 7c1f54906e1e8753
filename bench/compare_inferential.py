"""Loadmaster vs Inferential 1.4.0's own server, same machine, same run, same stock client.

    python bench/compare_inferential.py            # all five comparisons (~2 minutes)
    python bench/compare_inferential.py --quick    # fewer requests, for a look

The reference is stock Inferential as its README configures it: `LocalDispatcher` calling the
model inline (`_inferential.inferential_server(mode="inline")`). Every ratio and target is
against it. A second Inferential variant of ours, each model call in a worker thread
(`mode="threaded"`, not stock), is measured too and reported under `inferential_threaded`,
labelled, for the head-of-line comparison (stock Inferential blocks its loop on a slow model).

Comparisons (targets from issue 8):
- small observation (7 x float32, `double`) round trip, sequential: p50 and p99 <= 1.0x Inferential
- image observation (uint8 640x480x3, `double`) round trip, sequential: p50 and p99 <= 1.0x
- throughput, 8 client processes, closed loop, `double`: >= 1.5x
- head-of-line: p99 of `double` while 4 clients saturate a 50 ms `sleep` model: <= 3 ms
- idle CPU of the whole system over 10 s: <= 1 % of one core
Writes bench/results/compare_inferential.json and compare_inferential.png.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import uuid
from typing import Any

import numpy as np
from _harness import RESULTS, percentiles_ms, running_suite_handle, write_result
from _inferential import inferential_server
from _load import run_load
from idle_probe import cpu_seconds, process_tree
from inferential import Connection

SMALL = {"x": np.arange(7, dtype=np.float32)}
IMAGE = {"x": np.random.default_rng(0).integers(0, 255, (480, 640, 3), dtype=np.uint8)}
SLEEP = {"ms": np.array([50.0], dtype=np.float32)}
# Start-up work is not idle time: each Loadmaster service collects garbage once and freezes
# what start-up left alive just after it starts serving (hundreds of ms in a worker with torch
# loaded), which can fall inside the first idle window. Both servers get the same settle.
SETTLE_S = 3.0


def sequential(edge: str, inputs: dict[str, np.ndarray], requests: int, warmup: int = 50) -> list[float]:
    conn = Connection(server=edge, client_id=f"seq-{uuid.uuid4().hex[:6]}")
    model = conn.model("double")
    samples = []
    try:
        for i in range(warmup + requests):
            started = time.perf_counter()
            model.observe(**inputs)
            result = model.get_result(timeout_ms=5000)
            if result is None or "error_code" in result:
                raise RuntimeError(f"request {i} failed: {result}")
            if i >= warmup:
                samples.append(time.perf_counter() - started)
    finally:
        conn.close()
    return samples


def head_of_line(edge: str, seconds: float) -> dict[str, Any]:
    """p99 of sequential `double` requests while 4 processes keep `sleep` (50 ms) saturated."""
    box: dict[str, Any] = {}
    loader = threading.Thread(
        target=lambda: box.setdefault(
            "load", run_load(edge, "sleep", SLEEP, clients=4, duration_s=seconds + 3)
        )
    )
    loader.start()
    time.sleep(2.5)  # the sleep clients are running
    deadline = time.monotonic() + seconds
    samples: list[float] = []
    while time.monotonic() < deadline:
        samples += sequential(edge, SMALL, requests=50, warmup=0)
    loader.join()
    load = box["load"]
    return {**percentiles_ms(samples), "sleep_requests": load.requests, "sleep_errors": load.errors}


def idle_cpu_percent(pids: list[int], seconds: float = 10.0) -> float:
    """CPU of the processes (children included) over `seconds`, in % of one core."""
    processes = [process for pid in pids for process in process_tree(pid)]
    before = sum(cpu_seconds(p) for p in processes)
    time.sleep(seconds)
    return (sum(cpu_seconds(p) for p in processes) - before) / seconds * 100


def measure(edge: str, pids: list[int], quick: bool) -> dict[str, Any]:
    n_small, n_image, seconds = (300, 50, 4.0) if quick else (2000, 300, 10.0)
    print("  idle CPU…", flush=True)
    time.sleep(SETTLE_S)
    idle = idle_cpu_percent(pids, 5.0 if quick else 10.0)
    print("  small observations…", flush=True)
    small = percentiles_ms(sequential(edge, SMALL, n_small))
    print("  image observations…", flush=True)
    image = percentiles_ms(sequential(edge, IMAGE, n_image, warmup=10))
    print("  throughput (8 processes)…", flush=True)
    load = run_load(edge, "double", SMALL, clients=8, duration_s=seconds)
    print("  head-of-line…", flush=True)
    hol = head_of_line(edge, seconds)
    return {
        "small": small,
        "image": image,
        "throughput_rps": round(load.throughput, 1),
        "throughput_errors": load.errors + load.timeouts,
        "head_of_line": hol,
        "idle_cpu_percent_of_one_core": round(idle, 2),
    }


def _target(name: str, measured: float, target: float, unit: str, ok: bool) -> dict[str, Any]:
    return {"name": name, "measured": round(measured, 3), "target": target, "unit": unit, "met": bool(ok)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    overrides = {"models": {"known": {"sleep": {"max_inflight": 4}, "double": {"max_inflight": 4}}}}
    with running_suite_handle(preload=["double", "sleep"], overrides=overrides) as suite:
        pids = [p.process.pid for p in suite.processes]
        if suite.redis is not None and suite.redis.process is not None:
            pids.append(suite.redis.process.pid)
        print("Loadmaster:", flush=True)
        ours = measure(suite.settings.gateway.edge.bind, pids, args.quick)
    measured: dict[str, dict[str, Any]] = {}
    for mode in ("inline", "threaded"):
        with inferential_server(
            "model_deadline", max_inflight={"sleep": 4, "double": 4}, mode=mode
        ) as address:
            import psutil as _psutil

            server_pids = [
                p.pid
                for p in _psutil.process_iter(["cmdline"])
                if any("_inferential.py" in c for c in (p.info["cmdline"] or []))
            ]
            label = "stock, LocalDispatcher inline" if mode == "inline" else "threaded variant (not stock)"
            print(f"Inferential ({label}):", flush=True)
            measured[mode] = measure(address, server_pids, args.quick)
    theirs = measured["inline"]

    def ratio(a: float, b: float) -> float:
        return round(a / b, 3) if b else float("inf")

    ratios = {
        "small_p50": ratio(ours["small"]["p50_ms"], theirs["small"]["p50_ms"]),
        "small_p99": ratio(ours["small"]["p99_ms"], theirs["small"]["p99_ms"]),
        "image_p50": ratio(ours["image"]["p50_ms"], theirs["image"]["p50_ms"]),
        "image_p99": ratio(ours["image"]["p99_ms"], theirs["image"]["p99_ms"]),
        "throughput": ratio(ours["throughput_rps"], theirs["throughput_rps"]),
    }
    targets = [
        _target("small p50 vs Inferential", ratios["small_p50"], 1.0, "x", ratios["small_p50"] <= 1.0),
        _target("small p99 vs Inferential", ratios["small_p99"], 1.0, "x", ratios["small_p99"] <= 1.0),
        _target("image p50 vs Inferential", ratios["image_p50"], 1.0, "x", ratios["image_p50"] <= 1.0),
        _target("image p99 vs Inferential", ratios["image_p99"], 1.0, "x", ratios["image_p99"] <= 1.0),
        _target("throughput vs Inferential", ratios["throughput"], 1.5, "x", ratios["throughput"] >= 1.5),
        _target(
            "head-of-line p99 (Loadmaster)",
            ours["head_of_line"]["p99_ms"],
            3.0,
            "ms",
            ours["head_of_line"]["p99_ms"] <= 3.0,
        ),
        _target(
            "idle CPU (Loadmaster)",
            ours["idle_cpu_percent_of_one_core"],
            1.0,
            "% of a core",
            ours["idle_cpu_percent_of_one_core"] <= 1.0,
        ),
    ]
    path = write_result(
        "compare_inferential",
        {
            "quick": args.quick,
            "loadmaster": ours,
            "inferential": theirs,
            "inferential_reference": "stock Inferential 1.4.0, LocalDispatcher calling the model inline",
            "inferential_threaded": measured["threaded"],
            "inferential_threaded_note": "not stock: each model call in a worker thread (asyncio.to_thread)",
            "ratios": ratios,
            "targets": targets,
        },
    )
    _plot(ours, theirs)
    for t in targets:
        print(
            f"{'MET ' if t['met'] else 'MISS'} {t['name']}: {t['measured']} (target {t['target']} {t['unit']})"
        )
    print(f"wrote {path}")
    return 0


def _plot(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["small p50", "small p99", "image p50", "image p99", "HOL p50", "HOL p99"]

    def values(r: dict[str, Any]) -> list[float]:
        return [
            r["small"]["p50_ms"],
            r["small"]["p99_ms"],
            r["image"]["p50_ms"],
            r["image"]["p99_ms"],
            r["head_of_line"]["p50_ms"],
            r["head_of_line"]["p99_ms"],
        ]

    x = np.arange(len(labels))
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    left.bar(x - 0.2, values(ours), 0.4, label="Loadmaster")
    left.bar(x + 0.2, values(theirs), 0.4, label="Inferential 1.4.0")
    left.set_xticks(x, labels)
    left.set_ylabel("ms (lower is better)")
    left.set_yscale("log")
    left.legend()
    right.bar(
        ["Loadmaster", "Inferential"], [ours["throughput_rps"], theirs["throughput_rps"]], color=["C0", "C1"]
    )
    right.set_ylabel("requests/s, 8 clients (higher is better)")
    figure.suptitle("Loadmaster vs Inferential, same machine and client")
    figure.tight_layout()
    figure.savefig(RESULTS / "compare_inferential.png", dpi=100)


if __name__ == "__main__":
    sys.exit(main())
