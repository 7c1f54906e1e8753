"""A model-pool worker frozen with SIGSTOP under load (issue 33, docs/liveness.md).

A suite with two workers; for each tensor front end in turn (the edge with stock `inferential`
clients, KServe v2 over HTTP and over gRPC with `tritonclient`), `--rate` requests/s of
`double` from `--clients` clients on a cadence, the second worker frozen `--before` seconds
in, the load kept on `--after` seconds more, then the worker thawed (it registers again) for
the next round; `--rounds` rounds per front end. Last, a streamed `tiny-chat` generation on
the second worker, frozen after its first chunk: how long until its stream ends.

Per front end: requests without a reply (each client waits NO_REPLY_S), error replies, the
first good reply after the freeze, and `recovered_s`, when the last request the freeze held
up was answered; and when the scheduler dropped the frozen worker. The promise is 2 s.

    .venv/bin/python bench/worker_freeze.py                 # 100 req/s, 3 rounds per front end
    .venv/bin/python bench/worker_freeze.py --rate 200 --rounds 5

Writes bench/results/worker_freeze.json.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import _liveness as liveness
from _harness import running_suite_handle, write_result

from loadmaster.common.liveness import LIVENESS


def _round(
    suite: Any, name: str, args: argparse.Namespace, victim: Any, data_endpoint: str
) -> dict[str, Any]:
    scheduler = suite.settings.scheduler.address
    liveness.wait_for_workers(scheduler, 2, "double")
    load = liveness.FrontEndLoad(
        name, liveness.front_ends(suite)[name], rate_hz=args.rate, clients=args.clients
    )
    load.start()
    try:
        time.sleep(args.before)
        frozen_at = liveness.freeze(victim.process.pid)
        dropped_s = liveness.watch_scheduler_drop(scheduler, data_endpoint, frozen_at)
        time.sleep(max(0.0, frozen_at + args.after - time.monotonic()))
    finally:
        calls = load.stop()
        liveness.thaw(victim.process.pid)
    return {"front_end": name, **liveness.summarize(calls, frozen_at), "scheduler_dropped_s": dropped_s}


def _stream_round(suite: Any, victim: Any, data_endpoint: str) -> dict[str, Any]:
    scheduler = suite.settings.scheduler.address
    liveness.wait_for_workers(scheduler, 2, "double")
    liveness.load_model_on(victim.address, "tiny-chat")
    liveness.wait_for_workers(scheduler, 1, "tiny-chat")
    gateway = suite.settings.gateway
    stream = liveness.StreamWatch(f"http://{gateway.http_host}:{gateway.http_port}/v1")
    stream.start()
    try:
        if not stream.first_chunk.wait(120) or not stream.chunks:
            return {"outcome": f"never started: {stream.outcome}"}
        chunks_before = stream.chunks
        frozen_at = liveness.freeze(victim.process.pid)
        dropped_s = liveness.watch_scheduler_drop(scheduler, data_endpoint, frozen_at)
        stream.join(liveness.NO_REPLY_S + 5)
    finally:
        liveness.thaw(victim.process.pid)
    return {
        "outcome": stream.outcome,
        "chunks_before_freeze": chunks_before,
        "ended_s": None if stream.ended_at is None else round(stream.ended_at - frozen_at, 3),
        "scheduler_dropped_s": dropped_s,
    }


def _worst(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [row[key] for row in rows if row.get(key) is not None]
    return max(values) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=100.0, help="requests/s per front end")
    parser.add_argument("--clients", type=int, default=8, help="stock clients per front end")
    parser.add_argument("--rounds", type=int, default=3, help="freezes per front end")
    parser.add_argument("--before", type=float, default=2.0, help="seconds of load before the freeze")
    parser.add_argument("--after", type=float, default=6.0, help="seconds of load after the freeze")
    parser.add_argument("--no-stream", action="store_true", help="skip the streamed generation")
    args = parser.parse_args()

    rows: list[dict[str, Any]] = []
    with running_suite_handle(preload=["double"], workers=2) as suite:
        victim = suite.service("model-pool-1")
        data_endpoint = liveness.data_endpoint_of(victim.address)
        for index in range(args.rounds):
            for name in liveness.FRONT_END_NAMES:
                row = _round(suite, name, args, victim, data_endpoint)
                rows.append({"round": index + 1, **row})
                print(json.dumps(rows[-1]), flush=True)
        stream = None if args.no_stream else _stream_round(suite, victim, data_endpoint)
        print("stream:", json.dumps(stream), flush=True)

    promise = LIVENESS.detect_within_s
    targets = []
    for name in liveness.FRONT_END_NAMES:
        mine = [row for row in rows if row["front_end"] == name]
        first = _worst(mine, "first_good_reply_s")
        recovered = _worst(mine, "recovered_s")
        unanswered = sum(row["no_reply"] for row in mine)
        targets += [
            {
                "name": f"{name}: first good reply after the freeze (worst round)",
                "measured": first,
                "target": promise,
                "unit": "s",
                "met": first is not None and first <= promise,
            },
            {
                "name": f"{name}: every held-up request answered by (worst round)",
                "measured": recovered,
                "target": promise,
                "unit": "s",
                "met": recovered is not None and recovered <= promise,
            },
            {
                "name": f"{name}: requests without a reply",
                "measured": unanswered,
                "target": 0,
                "unit": "requests",
                "met": unanswered == 0,
            },
        ]
    dropped = _worst(rows, "scheduler_dropped_s")
    targets.append(
        {
            "name": "scheduler dropped the frozen worker (worst round)",
            "measured": dropped,
            "target": promise,
            "unit": "s",
            "met": dropped is not None and dropped <= promise,
        }
    )
    if stream is not None:
        ended = stream.get("ended_s")
        targets.append(
            {
                "name": "stream on the frozen worker ended with an error event",
                "measured": ended,
                "target": promise,
                "unit": "s",
                "met": str(stream.get("outcome", "")).startswith("error event")
                and ended is not None
                and ended <= promise,
            }
        )
    result = {
        "rate_hz_per_front_end": args.rate,
        "clients_per_front_end": args.clients,
        "rounds": args.rounds,
        "promise_s": promise,
        "targets": targets,
        "tables": {"rounds": rows},
        "stream": stream,
    }
    path = write_result("worker_freeze", result)
    print(f"\n{'target':<70} {'measured':>10} {'target':>8}  met")
    for target in targets:
        print(f"{target['name']:<70} {target['measured']!s:>10} {target['target']!s:>8}  {target['met']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
