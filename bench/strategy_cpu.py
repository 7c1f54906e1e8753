"""The three deadline strategies side by side: 8 closed-loop stock Inferential clients on
`double` (compare_inferential's load point), each strategy switched in with SetStrategy on one
suite, two rounds: throughput, p99, and CPU per request, all and by process. Shows whether a
strategy's calls are ordered in the gateway's local queue (scheduler CPU ~10 us a call) or
take the central round trip (~300 us). Writes bench/results/strategy_cpu.json.

    .venv/bin/python bench/strategy_cpu.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import running_suite_handle, write_result
from compare_inferential import SETTLE_S, Server, load_point
from scheduler_overload import _use

STRATEGIES = ("model_deadline", "deadline_aware", "tiered_deadline")


def main() -> None:
    runs: list[dict[str, Any]] = []
    overrides = {"models": {"known": {"sleep": {"max_inflight": 4}, "double": {"max_inflight": 4}}}}
    with running_suite_handle(preload=["double", "sleep"], overrides=overrides) as suite:
        pids = {p.name: p.process.pid for p in suite.processes}
        ours = Server("loadmaster", "Loadmaster", suite.settings.gateway.edge.bind, pids)
        time.sleep(SETTLE_S)
        load_point(ours, 8, 3.0)  # warm-up
        for rnd in range(2):
            for strategy in STRATEGIES:
                _use(suite.settings.scheduler.address, strategy)
                time.sleep(1.5)
                load_point(ours, 8, 1.5)  # the share comes back after the switch
                r = load_point(ours, 8, 5.0)
                by = r["cpu_us_per_request_by_process"]
                print(
                    f"{strategy:16} {r['throughput_rps']:8.1f} req/s  p99 {r['p99_ms']:.2f} ms  "
                    f"CPU {r['cpu_us_per_request']:.0f} us/req (scheduler {by.get('scheduler')}, "
                    f"gateway {by.get('gateway')})",
                    flush=True,
                )
                runs.append({"round": rnd + 1, "strategy": strategy, **r})
    write_result("strategy_cpu", {"model": "double", "clients": 8, "seconds": 5.0, "runs": runs})


if __name__ == "__main__":
    main()
