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
5 ms and times: B's first call in flight -> B holds a credit and A still holds one ("split");
the moment A's clients stop sending -> B holds all 4 ("regained"). It also samples both
gateways' credits through phase 2 (the split). Targets: split <= 100 ms (issue 35's take-back
bound, now the time a second gateway takes to get slots of its own); regained <=
credit_window_s + share_period_s + 0.5 s. Repeats the cycle `--cycles` times (default 3).

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
            edge, "double", SMALL, clients=CLIENTS, duration_s=seconds, start_delay_s=START_DELAY_S
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
    return {
        "a_holds_whole_share_alone": whole_a is not None,
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
    split = [c["split_ms"] for c in cycles]
    regained = [c["regained_s"] for c in cycles]
    worst_split = max((t for t in split if t is not None), default=float("inf"))
    worst_regained = max((r for r in regained if r is not None), default=float("inf"))
    if None in split:
        worst_split = float("inf")
    if None in regained:
        worst_regained = float("inf")
    errors = sum(c["a_errors"] + c["b_errors"] for c in cycles)
    targets = [
        {
            "name": "both gateways hold slots after B's load starts (worst)",
            "measured": worst_split,
            "target": SPLIT_TARGET_MS,
            "unit": "ms",
            "met": worst_split <= SPLIT_TARGET_MS,
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
