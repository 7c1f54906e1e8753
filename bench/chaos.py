"""`make chaos`: break a running suite in every way issue 25 lists, under background traffic,
and record what each break cost.

    python bench/chaos.py                 # the whole run (bounded: about 5 minutes)
    python bench/chaos.py --only kill-worker,flushall

It starts `loadmaster up` (the real supervisor) with the example config on free ports,
preloading `double` and `echo`, and runs stock Inferential clients in their own processes
sending `double` at 200 req/s in all (each request tagged with a `request_id`, so every
reply, error replies too, is matched to its request). Then, one after another:

- kill -9 each process: gateway, scheduler, worker (model-pool), gpu-broker, metrics,
  redis-server (the supervisor restarts it);
- FLUSHALL the embedded Redis; restart Redis (SIGTERM: it exits, the supervisor restarts it);
- a maximum-size request: BYTES to `echo` just under `gateway.limits.max_payload_bytes`, over
  HTTP with tritonclient, binary and JSON;
- an edge client that sends 256 KB requests and never reads its replies;
- a fake worker: a `WorkerSession` with no credentials that registers `double` and listens on
  its own data port (does the scheduler send it clients' requests?);
- an impostor: a DEALER that connects with a background client's identity, sends one request
  and leaves (is the real client still served afterwards?).

For each scenario: background requests sent during it and never answered (the target is 0),
seconds from the fault until a request sent after it is answered OK, the worst background
latency, the gateway's resident-memory growth, and whether the memory the gpu-broker has
promised (its leases, plus memory a worker still holds for a lease that is gone) ever exceeded
a GPU's capacity (polled every 0.25 s). A scenario that cannot be run or does not recover is
reported as such, and the run goes on. Writes bench/results/chaos.json and bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from _chaos_report import Window, _measure, _targets
from _chaos_scenarios import Outcome, Scenario, _scenarios
from _chaos_suite import CLIENTS, RATE_HZ, Auditor, Background, RunningUp, _infer_double
from _harness import write_result

RECOVER_TIMEOUT_S = 12.0  # a scenario not serving again by then is reported as not recovered
OBSERVE_FAULT_S = 6.0  # a fault's window lasts at least this long (lease renewals come every 5 s)
SETTLE_S = 2.0
RUN_BUDGET_S = 330.0  # scenarios not started by then are reported as skipped


# ---- the run -----------------------------------------------------------------------------------


def run(only: set[str] | None, log_dir: Path) -> dict[str, Any]:
    began = time.monotonic()
    up = RunningUp(log_dir / "up.log")
    print(f"starting loadmaster up (log: {up.log_path})…", flush=True)
    up.start()
    deadline = time.monotonic() + 180
    while not _infer_double(up.http):
        if not up.alive or time.monotonic() > deadline:
            up.stop()
            raise SystemExit(f"the suite did not start; see {up.log_path}")
        time.sleep(0.5)
    print(f"suite serving after {time.monotonic() - began:.1f} s", flush=True)
    auditor = Auditor(up)
    auditor.start()
    background = Background(up.edge)
    background.start()
    while not background.served_since(0.0):  # both clients warmed up
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    windows: list[Window] = []
    skipped: list[str] = []
    baseline = Window(Scenario("baseline", lambda up, bg: Outcome(), "load"), time.time(), time.time())
    time.sleep(3.0)
    baseline.end = time.time()
    baseline.recovered = True
    windows.append(baseline)
    for scenario in _scenarios():
        if only and scenario.name not in only:
            continue
        if time.monotonic() - began > RUN_BUDGET_S:
            skipped.append(scenario.name)
            continue
        print(f"-- {scenario.name}", flush=True)
        window = Window(scenario, start=windows[-1].end, fault=time.time())
        try:
            window.outcome = scenario.action(up, background)
        except Exception as error:  # a scenario that cannot run is reported, not fatal
            window.outcome = Outcome(detail=f"could not run: {type(error).__name__}: {error}"[:200])
        acted = time.time()
        if scenario.kind == "fault":
            time.sleep(max(0.0, window.fault + OBSERVE_FAULT_S - time.time()))
        wait_until = time.monotonic() + RECOVER_TIMEOUT_S
        while time.monotonic() < wait_until and not background.served_since(acted):
            time.sleep(0.05)
        window.recovered = background.served_since(acted)
        time.sleep(SETTLE_S)
        window.supervisor_alive = up.alive
        window.end = time.time()
        windows.append(window)
        print(f"   {window.outcome.detail}; serving again: {window.recovered}", flush=True)
        if not up.alive:
            print("   loadmaster up has exited: the remaining scenarios are skipped", flush=True)
            break
    records = background.finish()
    auditor.halt.set()
    auditor.join(5)
    code = up.stop()
    rows = [_measure(w, records, auditor.samples) for w in windows]
    ran = {w.scenario.name for w in windows}
    skipped += [
        s.name
        for s in _scenarios()
        if s.name not in ran and s.name not in skipped and (not only or s.name in only)
    ]
    rows += [
        {"scenario": name, "kind": "-", "skipped": "run budget spent or loadmaster up exited"}
        for name in skipped
    ]
    payload_limit_mb = up.settings.gateway.limits.max_payload_bytes / 2**20
    return {
        "rate_hz": RATE_HZ,
        "clients": CLIENTS,
        "duration_s": round(time.monotonic() - began, 1),
        "up_exit_code": code,
        "requests": len(records),
        "scenarios": rows,
        "targets": _targets([r for r in rows if r["scenario"] != "baseline"], payload_limit_mb),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated scenario names (default: all)")
    parser.add_argument("--logs", type=Path, help="folder for the suite's log (default: a temp folder)")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None
    import tempfile

    log_dir = args.logs or Path(tempfile.mkdtemp(prefix="loadmaster-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    result = run(only, log_dir)
    path = write_result("chaos", result)
    print(json.dumps(result["targets"], indent=2))
    print(f"wrote {path}")
    import report

    report.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
