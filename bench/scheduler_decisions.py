"""In-process scheduling decisions per second (enqueue + grant + complete), at queue depth 1k and 100k.

The `SchedulerCore` runs with the system clock and a sink that drops its answers, so this
measures the decisions only (no gRPC; the time inside `core.submit`, not building its inputs).
A decision = one Complete freeing a slot + one Enqueue + one Grant. The queue is first filled to the depth; then each
step completes one granted request, enqueues a new one and grants the head, so the depth
stays put. `batch` steps do the same with 64 of each per call, as the gateway's stream
delivers them under load. Target: >= 50,000 decisions/s at both depths.

The rate is wall time inside `core.submit`, garbage collections included (at depth 100k a
full collection walks every queued request). `cpu_decisions_per_s` divides by the
process's CPU time over the same calls instead: on a shared machine it leaves out the
time the OS gave other processes, so it is the steadier number to compare runs with.

The core runs with dispatch credits off (no gateway takes credits here);
`--shipped-mechanisms` runs it with CoreConfig's defaults, the shipped settings, instead.

    .venv/bin/python bench/scheduler_decisions.py [--seconds 2] [--strategies model_deadline,...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import write_result

from loadmaster.common.clock import SystemClock
from loadmaster.common.ordering import make_ordering
from loadmaster.scheduler.config import CoreConfig
from loadmaster.scheduler.core import SchedulerCore
from loadmaster.scheduler.domain import (
    Completion,
    Grant,
    Reject,
    RequestInfo,
    SlotState,
    SlotStatus,
    Submission,
    WorkerHello,
)

TARGET_PER_S = 50_000
ALL = [
    "model_deadline",
    "deadline_aware",
    "tiered_deadline",
    "batch_optimized",
    "priority_tiered",
    "round_robin",
]


class _Sink:
    __slots__ = ("granted", "rejected")

    def __init__(self) -> None:
        self.granted: list[str] = []
        self.rejected = 0

    def grant(self, session_id: int, grant: Grant) -> None:
        self.granted.append(grant.request_id)

    def reject(self, session_id: int, reject: Reject) -> None:
        self.rejected += 1

    def command(self, worker_id: str, command: object) -> None:
        pass


MECHANISMS_OFF: dict[str, Any] = {"dispatch_credits": 0, "lookahead": 0}


def run(strategy: str, depth: int, batch: int, seconds: float, *, shipped: bool = False) -> dict[str, Any]:
    sink = _Sink()
    config = CoreConfig(
        max_queue_size=depth + 10 * batch,
        request_ttl_ms=600_000.0,
        max_inflight=lambda m: batch,
        **({} if shipped else MECHANISMS_OFF),
    )
    core = SchedulerCore(config, clock=SystemClock(), outbound=sink, ordering=make_ordering(strategy))
    core.add_worker(WorkerHello("w", "tcp://127.0.0.1:1", repository=("m",)))
    clients = [f"client-{i}" for i in range(16)]
    n = 0

    def info(i: int) -> RequestInfo:
        return RequestInfo(f"r{i}", "m", client_id=clients[i % 16], priority=i % 3, urgency=(i % 10) / 10)

    chunk = 10_000
    while n < depth:  # fill, nothing READY yet
        size = min(chunk, depth - n)
        core.submit(1, Submission(enqueues=[info(n + k) for k in range(size)]))
        n += size
    core.update_worker("w", [SlotStatus("m", SlotState.READY, generation=1)])
    # the first grants went out on READY; from here each step keeps the depth constant
    steps = decisions = 0
    elapsed = 0.0  # inside core.submit only: building the inputs is the wire layer's cost
    cpu = 0.0
    deadline = time.perf_counter() + seconds
    clock, cpu_clock = time.perf_counter, time.process_time
    while True:
        done = sink.granted[:]
        sink.granted.clear()
        completes = [Completion(rid, worker_id="w") for rid in done]
        enqueues = [info(n + k) for k in range(len(done))]
        n += len(done)
        submission = Submission(enqueues=enqueues, completes=completes)
        t, c = clock(), cpu_clock()
        core.submit(1, submission)
        elapsed += clock() - t
        cpu += cpu_clock() - c
        decisions += len(done)
        steps += 1
        if steps % 64 == 0 and clock() >= deadline:
            break
    rate = decisions / elapsed
    return {
        "strategy": strategy,
        "mechanisms": "shipped" if shipped else "off",
        "depth": depth,
        "batch": batch,
        "decisions": decisions,
        "seconds": round(elapsed, 3),
        "decisions_per_s": round(rate),
        "cpu_decisions_per_s": round(decisions / cpu) if cpu > 0 else None,
        "meets_target": rate >= TARGET_PER_S,
        "rejected": sink.rejected,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--strategies", default=",".join(ALL))
    parser.add_argument("--shipped-mechanisms", action="store_true", help="credits on, as shipped")
    args = parser.parse_args()
    rows = []
    for strategy in args.strategies.split(","):
        for depth in (1_000, 100_000):
            for batch in (1, 64):
                row = run(strategy, depth, batch, args.seconds, shipped=args.shipped_mechanisms)
                rows.append(row)
                print(
                    f"{strategy:16} depth {depth:>7,} batch {batch:>2}: {row['decisions_per_s']:>9,}/s "
                    f"{'OK' if row['meets_target'] else 'below'} (target {TARGET_PER_S:,}/s; "
                    f"{row['cpu_decisions_per_s'] or 0:,}/s of CPU time)",
                    flush=True,
                )
    targets = []
    for depth in (1_000, 100_000):
        best = max(
            (r for r in rows if r["depth"] == depth and r["strategy"] == "model_deadline"),
            key=lambda r: r["decisions_per_s"],
            default=None,
        )
        if best is not None:
            targets.append(
                {
                    "name": f"model_deadline decisions/s at depth {depth:,} (batch {best['batch']})",
                    "measured": best["decisions_per_s"],
                    "target": TARGET_PER_S,
                    "unit": "/s",
                    "met": best["meets_target"],
                }
            )
    name = "scheduler_decisions_shipped" if args.shipped_mechanisms else "scheduler_decisions"
    path = write_result(name, {"targets": targets, "runs": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
