"""Soak: run the suite at a fraction of its measured capacity and watch errors and memory.

    python bench/soak.py                       # 10 minutes at 70 % (make soak)
    python bench/soak.py --duration 60         # a quick look

Capacity is measured first (closed loop, same clients, 10 s). Then every client sends on a
fixed cadence for `--duration` seconds while the RSS of every suite process is sampled.
Targets: 0 errors, < 10 % RSS growth after warm-up. Writes bench/results/soak.json and
bench/results/soak_rss.png.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np
import psutil
from _harness import RESULTS, percentiles_ms, running_suite_handle, write_result
from _load import run_load


def _sample_rss(
    pids: dict[str, int], stop: threading.Event, samples: list[tuple[float, dict[str, float]]]
) -> None:
    processes = {name: psutil.Process(pid) for name, pid in pids.items()}
    started = time.monotonic()
    while not stop.wait(5.0):
        row = {}
        for name, process in processes.items():
            try:
                row[name] = process.memory_info().rss / 2**20
            except psutil.Error:
                row[name] = float("nan")
        samples.append((time.monotonic() - started, row))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--warmup", type=float, default=60.0)
    parser.add_argument("--load", type=float, default=0.7, help="fraction of measured capacity")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--model", default="double")
    args = parser.parse_args()
    inputs = {"x": np.arange(7, dtype=np.float32)}
    with running_suite_handle(preload=[args.model]) as suite:
        edge = suite.settings.gateway.edge.bind
        print(f"measuring capacity with {args.clients} clients for 10 s…", flush=True)
        capacity = run_load(edge, args.model, inputs, clients=args.clients, duration_s=10).throughput
        rate = capacity * args.load / args.clients
        print(
            f"capacity {capacity:.0f} req/s; soaking at {rate * args.clients:.0f} req/s for {args.duration:.0f} s"
        )
        pids = {p.name: p.process.pid for p in suite.processes}
        if suite.redis is not None and suite.redis.process is not None:
            pids["redis"] = suite.redis.process.pid
        samples: list[tuple[float, dict[str, float]]] = []
        stop = threading.Event()
        sampler = threading.Thread(target=_sample_rss, args=(pids, stop, samples), daemon=True)
        sampler.start()
        try:
            load = run_load(
                edge, args.model, inputs, clients=args.clients, duration_s=args.duration, rate_hz=rate
            )
        finally:
            stop.set()
            sampler.join()
    after_warmup = [row for t, row in samples if t >= args.warmup] or [row for _, row in samples]
    growth = {
        name: round((after_warmup[-1][name] - after_warmup[0][name]) / after_warmup[0][name] * 100, 2)
        for name in pids
        if after_warmup and after_warmup[0][name] > 0
    }
    errors = load.errors + load.timeouts
    result = {
        "duration_s": args.duration,
        "capacity_rps": round(capacity, 1),
        "offered_rps": round(rate * args.clients, 1),
        "achieved_rps": round(load.throughput, 1),
        "errors": errors,
        "error_codes": load.error_codes,
        "timeouts": load.timeouts,
        "latency": percentiles_ms(load.latencies_s) if load.latencies_s else {},
        "rss_growth_percent_after_warmup": growth,
        "rss_mb_samples": [
            {"t_s": round(t, 1), **{k: round(v, 1) for k, v in row.items()}} for t, row in samples
        ],
        "targets": [
            {
                "name": "errors during the soak",
                "measured": errors,
                "target": 0,
                "unit": "",
                "met": errors == 0,
            },
            {
                "name": "largest RSS growth after warm-up",
                "measured": max(growth.values(), default=0.0),
                "target": 10,
                "unit": "%",
                "met": all(g < 10 for g in growth.values()),
            },
        ],
        "met": errors == 0 and all(g < 10 for g in growth.values()),
    }
    path = write_result("soak", result)
    _plot(samples, args.warmup)
    print(f"errors {errors}; RSS growth after warm-up (%): {growth}")
    print(f"wrote {path}")
    return 0 if result["met"] else 1


def _plot(samples: list[tuple[float, dict[str, float]]], warmup: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not samples:
        return
    figure, axis = plt.subplots(figsize=(8, 4))
    for name in samples[0][1]:
        axis.plot([t for t, _ in samples], [row[name] for _, row in samples], label=name)
    axis.axvline(warmup, color="grey", linestyle="--", linewidth=1)
    axis.set_xlabel("seconds")
    axis.set_ylabel("RSS (MiB)")
    axis.set_title("Soak: resident memory per process")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(RESULTS / "soak_rss.png", dpi=100)


if __name__ == "__main__":
    sys.exit(main())
