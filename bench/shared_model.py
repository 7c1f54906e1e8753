"""Two busy gateways on one short model: its slots split between them, against every call
granted by the scheduler (docs/data-path.md "Shares between gateways").

Real processes on free 127.0.0.1 ports: a suite (gateway A included) plus a second gateway B
on the same scheduler, model `double` (4 slots on one worker), stock Inferential clients in
closed loops. Arrangements, each `--rounds` times, alternating within a suite:

    split         4 clients on A and 4 on B; the scheduler splits the slots by the demand
                  the gateways report, each gateway queues and orders its own calls
    one gateway   8 clients on A (reference: one gateway holding the whole share)
    central       4 + 4 as in `split`, in a second suite with `scheduler.dispatch_credits: 0`
                  (a labelled variant: every call queued in and granted by the scheduler, as
                  several gateways sharing a model were served before the split)

Measured per arrangement: calls/s (both gateways together), latency p50/p99, errors, and CPU
per call of the scheduler process and of all the suite's processes (psutil, over the load).
Target: with the split, two gateways serve at least the calls/s of the central arrangement at
less scheduler CPU per call.

    .venv/bin/python bench/shared_model.py [--seconds 5] [--rounds 2]

Writes bench/results/shared_model.json.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import numpy as np
import psutil
from _harness import percentiles_ms, print_targets, running_suite_handle, write_result
from _load import LoadResult, run_load

SMALL = {"x": np.arange(7, dtype=np.float32)}
SLOTS = 4
CLIENTS = 4  # per gateway
START_DELAY_S = 2.5


def _cpu_s(pids: dict[str, int]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, pid in pids.items():
        try:
            proc = psutil.Process(pid)
            times = [proc.cpu_times(), *(c.cpu_times() for c in proc.children(recursive=True))]
        except psutil.Error:
            continue
        out[name] = sum(t.user + t.system for t in times)
    return out


def run_arrangement(edges: list[str], suite: Any, seconds: float) -> dict[str, Any]:
    """CLIENTS closed-loop clients per entry of `edges` (an edge twice: twice the clients)."""
    pids = {p.name: p.process.pid for p in suite.processes}
    results: list[LoadResult] = []
    lock = threading.Lock()

    def load(edge: str) -> None:
        result = run_load(
            edge, "double", SMALL, clients=CLIENTS, duration_s=seconds, start_delay_s=START_DELAY_S
        )
        with lock:
            results.append(result)

    threads = [threading.Thread(target=load, args=(edge,)) for edge in edges]
    for thread in threads:
        thread.start()
    time.sleep(START_DELAY_S)  # the clients import, then all start together
    before = _cpu_s(pids)
    for thread in threads:
        thread.join()
    after = _cpu_s(pids)
    calls = sum(r.requests for r in results)
    latencies = [s for r in results for s in r.latencies_s]
    cpu = {name: after[name] - before[name] for name in after if name in before}
    per_call = (lambda s: round(s / calls * 1e6, 1)) if calls else (lambda s: None)
    return {
        "calls_per_s": round(calls / seconds, 1),
        "latency": percentiles_ms(latencies) if latencies else {},
        "errors": sum(r.errors + r.timeouts for r in results),
        "scheduler_cpu_us_per_call": per_call(cpu.get("scheduler", 0.0)),
        "suite_cpu_us_per_call": per_call(sum(cpu.values())),
    }


def _suite_rounds(arrangements: dict[str, str], overrides: dict[str, Any], args: Any) -> dict[str, list]:
    out: dict[str, list] = {name: [] for name in arrangements}
    with running_suite_handle(preload=["double"], overrides=overrides) as suite:
        second = suite.start_service("gateway", index=1, timeout_s=90).overrides["gateway"]
        edge_a, edge_b = suite.settings.gateway.edge.bind, second["edge"]["bind"]
        plans = {"two": [edge_a, edge_b], "one": [edge_a, edge_a]}
        run_arrangement(plans["two"], suite, 2.0)  # warm-up: the model's time measured, shares lent
        for index in range(args.rounds):
            for name, plan in arrangements.items():
                print(f"round {index + 1}/{args.rounds}: {name}…", flush=True)
                row = run_arrangement(plans[plan], suite, args.seconds)
                print(f"  {row}", flush=True)
                out[name].append(row)
                time.sleep(1.5)  # the window passes: the next arrangement starts from the same state
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    models = {"models": {"known": {"double": {"max_inflight": SLOTS}}}}
    rows = _suite_rounds({"split": "two", "one_gateway": "one"}, models, args)
    rows |= _suite_rounds({"central": "two"}, {**models, "scheduler": {"dispatch_credits": 0}}, args)

    def mean(name: str, key: str) -> float:
        values = [float(r[key]) for r in rows[name] if r[key] is not None]
        return round(sum(values) / len(values), 1) if values else float("nan")

    summary = {
        name: {
            key: mean(name, key)
            for key in ("calls_per_s", "scheduler_cpu_us_per_call", "suite_cpu_us_per_call")
        }
        for name in rows
    }
    errors = sum(r["errors"] for name in rows for r in rows[name])
    split, central = summary["split"], summary["central"]
    targets = [
        {
            "name": "two gateways, split: calls/s against central grants",
            "measured": round(split["calls_per_s"] / central["calls_per_s"], 2),
            "target": 1.0,
            "unit": "x (at least)",
            "met": split["calls_per_s"] >= central["calls_per_s"],
        },
        {
            "name": "two gateways, split: scheduler CPU per call against central grants",
            "measured": round(split["scheduler_cpu_us_per_call"] / central["scheduler_cpu_us_per_call"], 2),
            "target": 1.0,
            "unit": "x (below)",
            "met": split["scheduler_cpu_us_per_call"] < central["scheduler_cpu_us_per_call"],
        },
        {"name": "errors", "measured": errors, "target": 0, "unit": "", "met": errors == 0},
    ]
    path = write_result(
        "shared_model",
        {
            "model": {"name": "double", "slots": SLOTS},
            "clients_per_gateway": CLIENTS,
            "seconds": args.seconds,
            "rounds": rows,
            "summary": summary,
            "targets": targets,
        },
    )
    print_targets(targets, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
