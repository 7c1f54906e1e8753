"""Priority across gateways: priority-0 calls at gateway A while priority-2 clients saturate
the same model through gateway B, against the same load through one gateway.

One suite (gateway A included) plus a second gateway process B on the same scheduler, real
processes on free 127.0.0.1 ports. Model `sleep` at 10 ms per call with 2 slots and 2
instances, so two calls run at once (capacity 200 calls/s). Stock Inferential clients:

    priority 0   1 client on gateway A, a control loop: one call every 50 ms (20/s), each
                 waited for (a robot's cadence)
    priority 2   6 clients, closed loop (each sends again when its reply comes), so the model
                 is always saturated and a queue always waits: on gateway B ("two gateways")
                 or on gateway A as well ("one gateway")

With `--model double` (a call of microseconds, short enough for local queues) the slots are
split between the gateways instead (docs/data-path.md "Shares between gateways"): gateway A,
with little demand, keeps one slot (every borrower does while there are enough), so its
priority-0 calls run on it. That run writes bench/results/two_gateway_priority_double.json.
It adds a third arrangement, a control ("other model"): the priority-2 clients saturate
`echo` (another model of microseconds, on the same worker) through gateway B, so nothing is
shared but the machine. On a 2-core host the priority-0 tail moves with how busy the machine
is; the control shows how much of the two-gateway p99 the second gateway's mere load explains,
apart from the sharing of slots.
At the default 6 s a round has 120 priority-0 calls, so a round's p99 is its second slowest
call; `--seconds 20` gives 400.

Measured per arrangement: the priority-0 calls' latency (p50, p99), the priority-2 calls'
throughput, errors. The arrangements alternate for `--rounds` rounds so that both see the same
machine. Target (issue 35): with two gateways, the priority-0 p99 is within 2x its p99 with one
gateway: another gateway's lower-priority load does not hold an urgent call back.

    .venv/bin/python bench/two_gateway_priority.py [--seconds 6] [--rounds 2] [--model double]

Writes bench/results/two_gateway_priority.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from typing import Any

import numpy as np
from _harness import percentiles_ms, print_targets, running_suite_handle, write_result

SLEEP_MS = 10.0
SLOTS = 2
LOW_CLIENTS = 6
HIGH_PERIOD_S = 0.05
WARMUP_S = 1.0
RATIO_TARGET = 2.0
CONTROL_MODEL = "echo"  # --model double's control: B's load on a model A does not call


def client_main(
    address: str,
    model_id: str,
    priority: int,
    period_s: float | None,
    seconds: float,
    start_at: float,
    out: Any,
) -> None:
    """One client process: `period_s` None is a closed loop; else one call per period, each
    waited for. Reports (latencies after the warm-up, error codes)."""
    from inferential import Connection

    conn = Connection(server=address, client_id=f"p{priority}-{mp.current_process().pid}")
    model = conn.model(model_id, priority=priority)
    inputs = {"ms": np.array([SLEEP_MS], dtype=np.float32)}
    if model_id != "sleep":
        inputs = {"x": np.arange(7, dtype=np.float32)}
    latencies: list[float] = []
    errors: dict[str, int] = {}
    while time.time() < start_at:
        time.sleep(0.002)
    begin = time.monotonic()
    next_send = begin
    while (now := time.monotonic()) - begin < WARMUP_S + seconds:
        if period_s is not None:
            if next_send > now:
                time.sleep(next_send - now)
            next_send += period_s
        sent = time.monotonic()
        model.observe(**inputs, priority=priority)
        result = model.get_result(timeout_ms=5000)
        if result is None or "error" in result:
            code = "no_reply" if result is None else str(result.get("error_code", "error"))
            errors[code] = errors.get(code, 0) + 1
            continue
        if sent - begin >= WARMUP_S:
            latencies.append(time.monotonic() - sent)
    conn.close()
    out.put((priority, latencies, errors))


def run_arrangement(
    model_id: str, high_edge: str, low_edge: str, seconds: float, *, low_model: str | None = None
) -> dict[str, Any]:
    """One priority-0 control loop on `high_edge`, LOW_CLIENTS closed loops on `low_edge`
    (calling `low_model`, by default the same model)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 1.0 + 0.5 * (LOW_CLIENTS + 1) / 2  # every process imported first
    plan = [(high_edge, model_id, 0, HIGH_PERIOD_S)] + [
        (low_edge, low_model or model_id, 2, None)
    ] * LOW_CLIENTS
    processes = [
        ctx.Process(target=client_main, args=(edge, model, priority, period, seconds, start_at, out))
        for edge, model, priority, period in plan
    ]
    for process in processes:
        process.start()
    high: list[float] = []
    low: list[float] = []
    errors: dict[str, int] = {}
    try:
        for _ in processes:
            priority, latencies, codes = out.get(timeout=start_at - time.time() + WARMUP_S + seconds + 60)
            (high if priority == 0 else low).extend(latencies)
            for code, count in codes.items():
                errors[code] = errors.get(code, 0) + count
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
    return {
        "_priority0_s": high,  # the calls themselves, for the p99 over all rounds (not written)
        "priority0": percentiles_ms(high) if high else {"count": 0},
        "priority2": {"calls_per_s": round(len(low) / seconds, 1), **(percentiles_ms(low) if low else {})},
        "errors": errors,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="measured seconds per arrangement")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", choices=("sleep", "double"), default="sleep")
    args = parser.parse_args()
    known = {
        "sleep": {"max_inflight": SLOTS, "instances": SLOTS, "vram_mb": 16},
        "double": {"max_inflight": SLOTS},
    }
    overrides = {"models": {"known": {args.model: known[args.model]}}}
    preload = [args.model]
    if args.model == "double":
        overrides["models"]["known"][CONTROL_MODEL] = {"max_inflight": SLOTS}
        preload.append(CONTROL_MODEL)
    rounds: list[dict[str, Any]] = []
    with running_suite_handle(preload=preload, overrides=overrides) as suite:
        second = suite.start_service("gateway", index=1, timeout_s=90).overrides[
            "gateway"
        ]  # stopped with the suite
        edge_a, edge_b = suite.settings.gateway.edge.bind, second["edge"]["bind"]
        arrangements = [("one_gateway", edge_a, None), ("two_gateways", edge_b, None)]
        if args.model == "double":
            arrangements.append(("other_model", edge_b, CONTROL_MODEL))
        for index in range(args.rounds):
            row: dict[str, Any] = {}
            for name, low_edge, low_model in arrangements:
                print(f"round {index + 1}/{args.rounds}: {name}…", flush=True)
                row[name] = run_arrangement(args.model, edge_a, low_edge, args.seconds, low_model=low_model)
                print(f"  { {k: v for k, v in row[name].items() if not k.startswith('_')} }", flush=True)
                time.sleep(2.0)  # the queues drain and the shares settle
            rounds.append(row)

    def worst(name: str, key: str) -> float:
        return max(float(r[name]["priority0"].get(key, float("inf"))) for r in rounds)

    one_p99, two_p99 = worst("one_gateway", "p99_ms"), worst("two_gateways", "p99_ms")
    control = {"other_model": worst("other_model", "p99_ms")} if args.model == "double" else {}
    # Each round's p99 rests on its few slowest calls (at 6 s, the second slowest of 120): the
    # p99 over every round's calls is the steadier figure, reported beside the target's.
    pooled = {
        name: percentiles_ms([s for r in rounds for s in r[name].pop("_priority0_s")])["p99_ms"]
        for name in rounds[0]
    }
    print(f"priority-0 p99 over all rounds (ms): {pooled}")
    ratios = [
        r["two_gateways"]["priority0"].get("p99_ms", float("inf"))
        / max(r["one_gateway"]["priority0"].get("p99_ms", float("inf")), 1e-9)
        for r in rounds
    ]
    errors = sum(sum(r[name]["errors"].values()) for r in rounds for name in r)
    targets = [
        {
            "name": "priority-0 p99 with the saturating load on another gateway / on the same one (worst round)",
            "measured": round(max(ratios), 2),
            "target": RATIO_TARGET,
            "unit": "x",
            "met": max(ratios) <= RATIO_TARGET,
        },
        {"name": "errors", "measured": errors, "target": 0, "unit": "", "met": errors == 0},
    ]
    path = write_result(
        "two_gateway_priority" if args.model == "sleep" else f"two_gateway_priority_{args.model}",
        {
            "model": {
                "name": args.model,
                "sleep_ms": SLEEP_MS if args.model == "sleep" else None,
                "slots": SLOTS,
            },
            "load": {
                "priority0": f"1 client, one call per {HIGH_PERIOD_S * 1000:.0f} ms, on gateway A",
                "priority2": f"{LOW_CLIENTS} closed-loop clients, on gateway B (two gateways) or A (one)"
                + (
                    f"; control: on B calling {CONTROL_MODEL} (other model)" if args.model == "double" else ""
                ),
                "seconds": args.seconds,
                "warmup_s": WARMUP_S,
            },
            "rounds": rounds,
            "worst_priority0_p99_ms": {"one_gateway": one_p99, "two_gateways": two_p99, **control},
            "priority0_p99_all_rounds_ms": pooled,
            "targets": targets,
        },
    )
    print_targets(targets, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
