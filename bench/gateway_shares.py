"""How a model's share of worker slots moves between two gateways (docs/data-path.md "Shares
between gateways").

One suite (gateway A included) plus a second gateway process B on the same scheduler, real
processes on free 127.0.0.1 ports, model `double` (4 slots on one worker). Stock Inferential
clients, closed loop, 4 per gateway:

    phase 1  A alone           A holds the whole share (4 credits, a local queue)
    phase 2  A and B           B's first request waits in the scheduler and reclaims one of A's
                               slots; once nothing waits there the model is split: both hold
                               credits and queue their own calls, in proportion to demand
    phase 3  B alone           B gets the whole share once A's last use ages out of
                               `scheduler.credit_window_s` (1 s) and the next measurement runs
                               (`scheduler.share_period_s`, 0.5 s)

Each gateway's `/healthz` reports the credits it holds (`shares`); the bench polls both every
5 ms. Times:
- "first answers": each of B's clients' first call, sent to a gateway that holds no slot of the
  model, from its send to its answer (the worst of the 4 and the best). The first waits in the
  scheduler while it reclaims one of A's slots, then runs on B's new share; the others queue
  behind it there. This is the take-back's cost to a client, and the target's measure. Every
  client first sends one call to a model that does not exist (`WARM_UP_MODEL`), so that its
  connection's first contact is not timed; A's clients' first answers are the control.
- "split (polled)": B's first call seen in flight -> B holds a credit and A still holds one, as
  the polls see it. On the loaded 2-core machine one poll pair of /healthz sometimes takes
  100-250 ms (28 November: the scheduler had lent B its slot 1-2 ms after B's first call reached
  it, in the cycles the polls put at 180 and 252 ms), so this is the polls' resolution more
  than the split's; it is kept for comparison with earlier runs.
- "regained": the moment A's clients stop sending -> B holds all 4.
It also samples both gateways' credits through phase 2 (the split). Targets: B's first answers
<= 100 ms, worst of every cycle (issue 35's take-back bound); regained <= credit_window_s +
share_period_s + 0.5 s. Repeats the cycle `--cycles` times (default 3).

    .venv/bin/python bench/gateway_shares.py [--cycles 3]
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import httpx
import numpy as np
from _harness import print_targets, running_suite_handle, write_result
from _load import LoadResult, run_load

SMALL = {"x": np.arange(7, dtype=np.float32)}
SLOTS = 4
CLIENTS = 4
POLL_S = 0.005
SPLIT_TARGET_MS = 100.0
START_DELAY_S = 1.5
# Each client's connection makes its first contact with a call here (answered `not found`) before
# its load starts: cold, on the saturated machine, a client's first call took 55-237 ms in 3 of 13
# cycles (28 November), which is not the take-back's doing; warmed, 12 of 12 cycles <= 45 ms.
WARM_UP_MODEL = "warm-up-no-such-model"


def _credits(http: httpx.Client, url: str) -> int:
    shares = http.get(url, timeout=2.0).json().get("shares", {})
    return int(shares.get("double", {}).get("credits", 0))


def _wait(predicate: Any, timeout_s: float) -> float | None:
    """Poll `predicate` every POLL_S; the monotonic time it first held, or None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(POLL_S)
    return None


def _load_in_thread(edge: str, seconds: float, box: dict[str, Any], key: str) -> threading.Thread:
    def run() -> None:
        # run_load's clients all start START_DELAY_S from now and stop sending `seconds` later
        box[key + "_stops"] = time.monotonic() + START_DELAY_S + seconds
        box[key] = run_load(
            edge,
            "double",
            SMALL,
            clients=CLIENTS,
            duration_s=seconds,
            start_delay_s=START_DELAY_S,
            warm_up_model=WARM_UP_MODEL,
        )
        box[key + "_ended"] = time.monotonic()

    thread = threading.Thread(target=run, name=key)
    thread.start()
    return thread


def cycle(edge_a: str, edge_b: str, url_a: str, url_b: str) -> dict[str, Any]:
    http = httpx.Client()
    box: dict[str, Any] = {}
    a = _load_in_thread(edge_a, 6.0, box, "a")
    whole_a = _wait(lambda: _credits(http, url_a) == SLOTS, 15.0)
    time.sleep(1.0)
    b = _load_in_thread(edge_b, 8.0, box, "b")
    # B's clients start together after their start delay: watch B's gateway for its first call
    b_busy = _wait(lambda: http.get(url_b, timeout=2.0).json().get("inflight", 0) > 0, 15.0)
    split = _wait(lambda: _credits(http, url_b) > 0 and _credits(http, url_a) > 0, 5.0)
    samples: list[tuple[int, int]] = []  # (A's credits, B's) while both send
    while time.monotonic() < box["a_stops"] - 0.2:
        samples.append((_credits(http, url_a), _credits(http, url_b)))
        time.sleep(0.05)
    whole_b = _wait(lambda: _credits(http, url_b) == SLOTS, 20.0)
    a.join()
    a_last = box["a_stops"]  # when A's clients stopped sending (their last requests were in flight)
    a_load: LoadResult = box["a"]
    b.join()
    b_load: LoadResult = box["b"]
    http.close()
    first = sorted(b_load.first_latencies_s)
    first_a = sorted(a_load.first_latencies_s)
    return {
        "a_holds_whole_share_alone": whole_a is not None,
        "a_first_answer_ms": [round(first_a[0] * 1000, 1), round(first_a[-1] * 1000, 1)] if first_a else None,
        "b_first_answer_ms": [round(first[0] * 1000, 1), round(first[-1] * 1000, 1)] if first else None,
        "split_ms": None if (split is None or b_busy is None) else round((split - b_busy) * 1000, 1),
        "split_credits_mean": [round(float(np.mean([x[i] for x in samples])), 2) for i in (0, 1)]
        if samples
        else None,
        "regained_s": None if whole_b is None else round(whole_b - a_last, 3),
        "a_requests": a_load.requests,
        "a_errors": a_load.errors + a_load.timeouts,
        "b_requests": b_load.requests,
        "b_errors": b_load.errors + b_load.timeouts,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=3)
    args = parser.parse_args()
    overrides = {"models": {"known": {"double": {"max_inflight": SLOTS}}}}
    cycles: list[dict[str, Any]] = []
    with running_suite_handle(preload=["double"], overrides=overrides) as suite:
        window_s = suite.settings.scheduler.credit_window_s
        period_s = suite.settings.scheduler.share_period_s
        second = suite.start_service("gateway", index=1, timeout_s=90).overrides[
            "gateway"
        ]  # stopped with the suite
        gw = suite.settings.gateway
        url_a = f"http://{gw.http_host}:{gw.http_port}/healthz"
        url_b = f"http://127.0.0.1:{second['http_port']}/healthz"
        for index in range(args.cycles):
            print(f"cycle {index + 1}/{args.cycles}…", flush=True)
            result = cycle(gw.edge.bind, second["edge"]["bind"], url_a, url_b)
            print(f"  {result}", flush=True)
            cycles.append(result)
            time.sleep(window_s + 0.5)  # nobody uses the model: the next cycle starts clean
    first = [c["b_first_answer_ms"] for c in cycles]
    regained = [c["regained_s"] for c in cycles]
    worst_first = max((f[1] for f in first if f is not None), default=float("inf"))
    worst_regained = max((r for r in regained if r is not None), default=float("inf"))
    if None in first:
        worst_first = float("inf")
    if None in regained:
        worst_regained = float("inf")
    errors = sum(c["a_errors"] + c["b_errors"] for c in cycles)
    targets = [
        {
            "name": "B's clients' first calls answered, B holding no slot at first (worst)",
            "measured": worst_first,
            "target": SPLIT_TARGET_MS,
            "unit": "ms",
            "met": worst_first <= SPLIT_TARGET_MS,
        },
        {
            "name": "whole share regained by gateway B after A's load ends (worst)",
            "measured": worst_regained,
            "target": window_s + period_s + 0.5,
            "unit": "s",
            "met": worst_regained <= window_s + period_s + 0.5,
        },
        {
            "name": "errors across both gateways",
            "measured": errors,
            "target": 0,
            "unit": "",
            "met": errors == 0,
        },
    ]
    path = write_result(
        "gateway_shares",
        {
            "slots": SLOTS,
            "clients_per_gateway": CLIENTS,
            "credit_window_s": window_s,
            "share_period_s": period_s,
            "cycles": cycles,
            "targets": targets,
        },
    )
    print_targets(targets, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
