"""Overload: the `sleep` model at 10 ms with max_inflight 1 (capacity 100/s) under 2x offered load.

8 client processes with the stock Inferential client, open loop (each sends on its own
schedule, whatever the replies): 2 clients priority 0 with a 30 ms latency budget, 6
clients priority 2 (50 ms budget, and metadata timeout_ms 200: an observation older than
that is useless to them). Each client sends 25/s, 200/s in all, at its own phase: the
clients' first sends are 5 ms apart (client i at i x 5 ms; `--p0-gap-ms` moves the second
priority-0 client), after every process has connected. Per class: on-time rate
(a result within the client's budget), p50/p99 latency of results, errors by code; and
goodput (results/s) against capacity.

One Loadmaster suite is started once (`loadmaster.cli.launcher.Suite`, real processes on
free ports); each strategy is switched in with the SetStrategy admin RPC, then measured.
Inferential 1.4.0's own server (model_deadline) runs the same workload through
bench/_inferential.py. Targets: priority-0 on-time >= 99 % under model_deadline, goodput
>= 95 % of capacity.

    .venv/bin/python bench/scheduler_overload.py [--seconds 8] [--strategies a,b] [--no-inferential]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import EXAMPLE_CONFIG, write_result

SLEEP_MS = 10.0
CAPACITY_PER_S = 1000.0 / SLEEP_MS
CLIENTS = 8
RATE_PER_CLIENT = 2 * CAPACITY_PER_S / CLIENTS  # 2x capacity in all
HIGH = {"budget_ms": 30.0, "priority": 0, "timeout_ms": None}
LOW = {"budget_ms": 50.0, "priority": 2, "timeout_ms": 200.0}
WARMUP_S = 1.0
DRAIN_S = 1.5
ALL = [
    "model_deadline",
    "deadline_aware",
    "tiered_deadline",
    "batch_optimized",
    "priority_tiered",
    "round_robin",
]


def _client_id(i: int) -> str:
    return f"hi-{i}" if i < 2 else f"lo-{i}"


def _klass(i: int) -> dict[str, Any]:
    return HIGH if i < 2 else LOW


def phase_s(index: int, p0_gap_ms: float | None) -> float:
    """When client `index` sends first, after the common start: the clients' phases spread
    over one period (5 ms apart), or the second priority-0 client `p0_gap_ms` after the first."""
    if index == 1 and p0_gap_ms is not None:
        return p0_gap_ms / 1000.0
    return (index / CLIENTS) / RATE_PER_CLIENT


def client_main(
    address: str, index: int, seconds: float, phase: float, ready: Any, go: Any, start: Any, out: Any
) -> None:
    """One client process: send on schedule for warmup + seconds, then drain; report samples."""
    from inferential import Connection

    klass = _klass(index)
    conn = Connection(server=address, client_id=_client_id(index))
    model = conn.model("sleep", latency_budget_ms=klass["budget_ms"], priority=klass["priority"])
    period = 1.0 / RATE_PER_CLIENT
    extra = {"timeout_ms": str(klass["timeout_ms"])} if klass["timeout_ms"] else {}
    ms = np.array([SLEEP_MS], dtype=np.float32)
    sent: dict[int, float] = {}
    order: list[int] = []  # outstanding seqs, oldest first (error replies carry no seq)
    samples: list[tuple[float, float | None, str]] = []  # (sent_at, latency_s or None, code)
    ready.put(index)
    if not go.wait(60):
        return
    # Every process is up before the common start, so the phases are the ones asked for
    # (a process that started late used to begin at once, at a phase left to chance).
    first = start.value + phase
    while (left := first - time.time()) > 0.002:
        time.sleep(left - 0.002)
    while time.time() < first:
        pass
    t0 = time.monotonic()
    end = t0 + WARMUP_S + seconds
    seq = 0
    next_send = t0

    def take(result: dict[str, Any]) -> None:
        now = time.monotonic()
        if "seq" in result:
            s = int(np.asarray(result["seq"]).reshape(-1)[0])
        elif order:
            s = order[0]
        else:
            return
        at = sent.pop(s, None)
        if at is None:
            return
        order.remove(s)
        code = str(result.get("error_code", "ok")) if "error" in result else "ok"
        if at >= t0 + WARMUP_S:
            samples.append((at, now - at, code))

    while True:
        now = time.monotonic()
        if now >= end + DRAIN_S or (now >= end and not sent):
            break
        if now >= next_send and now < end:
            sent[seq] = time.monotonic()
            order.append(seq)
            model.observe(ms=ms, seq=np.array([seq], dtype=np.int64), priority=klass["priority"], **extra)
            seq += 1
            next_send += period
            continue
        wait_ms = int(max(0.0, min(next_send if now < end else end + DRAIN_S, end + DRAIN_S) - now) * 1000)
        result = model.get_result(timeout_ms=max(1, wait_ms))
        if result is not None:
            take(result)
    for at in sent.values():
        if at >= t0 + WARMUP_S:
            samples.append((at, None, "no_reply"))
    conn.close()
    out.put((index, samples))


def run_clients(address: str, seconds: float, *, p0_gap_ms: float | None = None) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out, ready, go, start = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    procs = [
        ctx.Process(
            target=client_main,
            args=(address, i, seconds, phase_s(i, p0_gap_ms), ready, go, start, out),
        )
        for i in range(CLIENTS)
    ]
    for p in procs:
        p.start()
    results: dict[int, list[tuple[float, float | None, str]]] = {}
    try:
        for _ in range(CLIENTS):  # each process connected and waiting
            ready.get(timeout=60)
        start.value = time.time() + 0.2
        go.set()
        deadline = time.monotonic() + seconds + WARMUP_S + DRAIN_S + 30
        while len(results) < CLIENTS and time.monotonic() < deadline:
            index, samples = out.get(timeout=max(0.1, deadline - time.monotonic()))
            results[index] = samples
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return summarize(results, seconds)


def summarize(results: dict[int, list[tuple[float, float | None, str]]], seconds: float) -> dict[str, Any]:
    classes: dict[str, Any] = {}
    total_ok = 0
    for name, members, klass in (("priority0", range(2), HIGH), ("priority2", range(2, CLIENTS), LOW)):
        samples = [s for i in members for s in results.get(i, [])]
        ok = [lat for _, lat, code in samples if code == "ok" and lat is not None]
        on_time = sum(1 for lat in ok if lat * 1000 <= klass["budget_ms"])
        codes: dict[str, int] = {}
        for _, _, code in samples:
            codes[code] = codes.get(code, 0) + 1
        total_ok += len(ok)
        lat_ms = np.asarray(ok) * 1000 if ok else np.asarray([np.nan])
        classes[name] = {
            "sent": len(samples),
            "results": len(ok),
            "on_time": on_time,
            "on_time_rate": round(on_time / len(samples), 4) if samples else None,
            "p50_ms": round(float(np.percentile(lat_ms, 50)), 2),
            "p99_ms": round(float(np.percentile(lat_ms, 99)), 2),
            "codes": codes,
            "budget_ms": klass["budget_ms"],
        }
    goodput = total_ok / seconds
    return {
        "classes": classes,
        "goodput_per_s": round(goodput, 1),
        "goodput_of_capacity": round(goodput / CAPACITY_PER_S, 4),
        "clients_reporting": len(results),
    }


def _config(tmp: Path, lookahead: int) -> Path:
    data = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    data["models"]["repository"] = str((EXAMPLE_CONFIG.parent / data["models"]["repository"]).resolve())
    data["models"]["known"]["sleep"] = {
        "max_inflight": 1,
        "vram_mb": 16,
        "lookahead": lookahead,
    }
    data["model_pool"]["preload"] = ["sleep", "double"]
    data["clients"] = {
        "defaults": {"latency_budget_ms": LOW["budget_ms"]},
        "known": {_client_id(i): {"latency_budget_ms": HIGH["budget_ms"]} for i in range(2)},
    }
    path = tmp / "loadmaster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _drain_queues(address: str, timeout_s: float = 10.0) -> None:
    import grpc

    from loadmaster.v1 import scheduler_pb2, scheduler_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            queues = stub.GetQueues(scheduler_pb2.GetQueuesRequest(), timeout=5).queues
            if all(q.depth == 0 and q.inflight == 0 for q in queues):
                return
            time.sleep(0.1)


def _use(address: str, strategy: str) -> None:
    import grpc

    from loadmaster.v1 import scheduler_pb2, scheduler_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        scheduler_pb2_grpc.SchedulerServiceStub(channel).SetStrategy(
            scheduler_pb2.SetStrategyRequest(strategy=strategy), timeout=5
        )


def _line(label: str, r: dict[str, Any]) -> str:
    hi, lo = r["classes"]["priority0"], r["classes"]["priority2"]
    return (
        f"{label:28} p0 on-time {100 * (hi['on_time_rate'] or 0):6.2f}% p50 {hi['p50_ms']:7.2f} p99 {hi['p99_ms']:8.2f} | "
        f"p2 on-time {100 * (lo['on_time_rate'] or 0):6.2f}% p50 {lo['p50_ms']:7.2f} p99 {lo['p99_ms']:8.2f} | "
        f"goodput {r['goodput_per_s']:6.1f}/s ({100 * r['goodput_of_capacity']:.1f}%)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--strategies", default=",".join(ALL))
    parser.add_argument("--no-inferential", action="store_true")
    parser.add_argument(
        "--lookahead",
        type=int,
        default=1,
        help="calls the gateway stages behind the running one (0 = none; a variant other than 1: "
        "results go to scheduler_overload_lookahead<N>.json)",
    )
    parser.add_argument(
        "--p0-gap-ms",
        type=float,
        default=None,
        help="the second priority-0 client sends this long after the first (default: 5, the spread)",
    )
    args = parser.parse_args()
    runs: dict[str, Any] = {}
    from loadmaster.cli.launcher import Suite, free_port_overrides

    with tempfile.TemporaryDirectory(prefix="loadmaster-overload-") as tmp:
        config = _config(Path(tmp), args.lookahead)
        suite = Suite(config, overrides=free_port_overrides(), log_dir=Path(tmp))
        print("starting the suite…", flush=True)
        suite.start(timeout_s=120)
        try:
            suite.wait_for_models(["sleep", "double"], timeout_s=120)
            edge, scheduler = suite.settings.gateway.edge.bind, suite.settings.scheduler.address
            # One unmeasured pass first, so no strategy's numbers include the suite's first seconds.
            print("warm-up pass (not measured)…", flush=True)
            run_clients(edge, min(args.seconds, 4.0), p0_gap_ms=args.p0_gap_ms)
            _drain_queues(scheduler)
            for strategy in args.strategies.split(","):
                _use(scheduler, strategy)
                result = run_clients(edge, args.seconds, p0_gap_ms=args.p0_gap_ms)
                runs[f"loadmaster:{strategy}"] = result
                print(_line(f"loadmaster {strategy}", result), flush=True)
                _drain_queues(scheduler)
        finally:
            suite.stop()
        if not args.no_inferential:
            from _inferential import inferential_server

            budgets = {_client_id(i): HIGH["budget_ms"] for i in range(2)}
            # Stock Inferential as its README configures it (LocalDispatcher, model inline).
            with inferential_server(
                "model_deadline", max_inflight={"sleep": 1}, budgets_ms=budgets, mode="inline"
            ) as address:
                result = run_clients(address, args.seconds, p0_gap_ms=args.p0_gap_ms)
            runs["inferential:model_deadline"] = result
            print(_line("inferential model_deadline", result), flush=True)
    md = runs.get("loadmaster:model_deadline")
    targets = []
    variant = args.lookahead != 1
    label = f" (variant: lookahead {args.lookahead})" if variant else ""
    if md is not None:
        p0 = md["classes"]["priority0"]["on_time_rate"] or 0.0
        targets = [
            {
                "name": f"model_deadline priority-0 on-time rate{label}",
                "measured": round(100 * p0, 2),
                "target": 99.0,
                "unit": "%",
                "met": p0 >= 0.99,
            },
            {
                "name": f"model_deadline goodput of capacity{label}",
                "measured": round(100 * md["goodput_of_capacity"], 1),
                "target": 95.0,
                "unit": "%",
                "met": md["goodput_of_capacity"] >= 0.95,
            },
        ]
    path = write_result(
        f"scheduler_overload_lookahead{args.lookahead}" if variant else "scheduler_overload",
        {
            "workload": {
                "model": "sleep",
                "sleep_ms": SLEEP_MS,
                "max_inflight": 1,
                "lookahead": args.lookahead,
                "capacity_per_s": CAPACITY_PER_S,
                "clients": CLIENTS,
                "offered_per_s": RATE_PER_CLIENT * CLIENTS,
                "priority0": HIGH,
                "priority2": LOW,
                "seconds": args.seconds,
                "phases_ms": [round(phase_s(i, args.p0_gap_ms) * 1000, 2) for i in range(CLIENTS)],
            },
            "targets": targets,
            "runs": runs,
        },
    )
    for t in targets:
        print(
            f"{t['name']}: {t['measured']} {t['unit']} (target {t['target']} {t['unit']}: {'met' if t['met'] else 'missed'})"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
