"""Idle CPU of the suite, per process: where the issue-8 idle budget (<= 1 % of a core) goes.

    python bench/idle_probe.py                      # example preload (5 models), 30 s window
    python bench/idle_probe.py --preload double sleep --seconds 10   # compare_inferential's suite
    python bench/idle_probe.py --runs 3             # three suites in a row, medians reported

Starts the suite like the other benchmarks (`_harness.running_suite_handle`: free loopback
ports, the example config, embedded redis-server), waits for the preloaded models, lets
start-up work settle (`--settle`, as compare_inferential does), then reads each process's
CPU time (its children included) and voluntary context switches (all threads) over `--seconds`. Voluntary
switches count wake-ups: an idle process that wakes 10 times a second shows ~10/s. Nothing
sends requests. Writes bench/results/idle_probe.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
from _harness import running_suite_handle, write_result

# Each run's wall time is start-up (~20-40 s with torch) + settle + window; this caps the window.
MAX_SECONDS = 300.0


def process_tree(pid: int) -> list[psutil.Process]:
    process = psutil.Process(pid)
    return [process, *process.children(recursive=True)]


def cpu_seconds(process: psutil.Process) -> float:
    """User + system CPU time; 0 for a process that has ended."""
    try:
        times = process.cpu_times()
    except psutil.Error:
        return 0.0
    return float(times.user + times.system)


def cpu_by_name(trees: Mapping[str, list[psutil.Process]]) -> dict[str, float]:
    """CPU seconds (user + system) of each named process tree, now."""
    return {name: sum(cpu_seconds(process) for process in processes) for name, processes in trees.items()}


def cpu_us_per_request(
    before: Mapping[str, float], after: Mapping[str, float], requests: int
) -> dict[str, float]:
    """CPU µs each named process spent per request between two `cpu_by_name` readings, and
    their sum under "total"; every value is 0 when no request was served."""
    per = {
        name: round((after[name] - before[name]) / requests * 1e6, 1) if requests > 0 else 0.0
        for name in before
    }
    return {**per, "total": round(sum(per.values()), 1)}


def _voluntary_switches(pid: int) -> int:
    """Summed over the process's threads (psutil reads only the main thread's, and gRPC
    and redis-py do much of their waiting on threads of their own)."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            for line in status.read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
        except OSError:  # the thread ended meanwhile
            pass
    return total


def _sample(trees: dict[str, list[psutil.Process]]) -> dict[str, tuple[float, int]]:
    """(user+system CPU seconds, voluntary context switches) per named process tree."""
    out: dict[str, tuple[float, int]] = {}
    for name, processes in trees.items():
        cpu, switches = 0.0, 0
        for process in processes:
            cpu += cpu_seconds(process)
            switches += _voluntary_switches(process.pid)
        out[name] = (cpu, switches)
    return out


def probe(suite: Any, *, seconds: float, settle_s: float) -> dict[str, Any]:
    pids = {p.name: p.process.pid for p in suite.processes}
    if suite.redis is not None and suite.redis.process is not None:
        pids["redis"] = suite.redis.process.pid
    time.sleep(settle_s)
    trees = {name: process_tree(pid) for name, pid in pids.items()}
    before = _sample(trees)
    started = time.monotonic()
    time.sleep(seconds)
    after = _sample(trees)
    elapsed = time.monotonic() - started
    processes = {
        name: {
            "cpu_percent": round((after[name][0] - before[name][0]) / elapsed * 100, 3),
            "wakeups_per_s": round((after[name][1] - before[name][1]) / elapsed, 1),
        }
        for name in pids
    }
    total = sum(p["cpu_percent"] for p in processes.values())
    return {"seconds": round(elapsed, 2), "total_cpu_percent": round(total, 3), "processes": processes}


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    names = runs[0]["processes"].keys()
    return {
        "total_cpu_percent": round(statistics.median(r["total_cpu_percent"] for r in runs), 3),
        "processes": {
            name: {
                key: round(statistics.median(r["processes"][name][key] for r in runs), 3)
                for key in ("cpu_percent", "wakeups_per_s")
            }
            for name in names
        },
    }


def _print(title: str, result: dict[str, Any]) -> None:
    print(title)
    for name, values in sorted(result["processes"].items(), key=lambda kv: -kv[1]["cpu_percent"]):
        print(f"  {name:<12} {values['cpu_percent']:7.3f} %   {values['wakeups_per_s']:7.1f} wake-ups/s")
    print(f"  {'total':<12} {result['total_cpu_percent']:7.3f} %  (target <= 1 % of one core)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="measuring window per run")
    parser.add_argument("--settle", type=float, default=3.0, help="wait after the models are READY")
    parser.add_argument("--runs", type=int, default=1, help="suites started one after another")
    parser.add_argument("--preload", nargs="*", default=None, help="models to load (default: the config's)")
    args = parser.parse_args()
    seconds = min(args.seconds, MAX_SECONDS)
    runs = []
    for run in range(1, max(1, args.runs) + 1):
        with running_suite_handle(preload=args.preload) as suite:
            preload = list(suite.settings.model_pool.preload)
            print(f"run {run}: {len(preload)} model(s) READY; settling {args.settle:g} s…", flush=True)
            result = probe(suite, seconds=seconds, settle_s=args.settle)
        _print(f"run {run} ({result['seconds']} s):", result)
        runs.append(result)
    median = _medians(runs)
    if len(runs) > 1:
        _print(f"median of {len(runs)} runs:", median)
    path = write_result(
        "idle_probe",
        {"preload": preload, "seconds": seconds, "settle_s": args.settle, "median": median, "runs": runs},
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
