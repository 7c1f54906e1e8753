"""The CPU of the gateway's hold (`LocalShare.holds`) against the number of urgent edge clients.

Before a call starts on a model's slot, the gateway looks for more urgent clients due to send
while that call would run (docs/data-path.md, "Why this design"). The question here is whether
that look grows with the fleet. N priority-0 edge clients of one 10 ms model each send every
N x 10 ms, phases spread evenly, so together they fill one slot whatever N is; their cadence
is learnt through the share's own entry points (5 calls each, on a fake clock). Then `holds`
is timed for a priority-2 call, in-process, no suite.

Target: at 1,000 urgent clients a hold costs at most 50 us (the gateway's whole CPU for a
small call was ~150 us on the development VM), and 10,000 clients at most 4x what 10 cost.

    .venv/bin/python bench/gateway_holds.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import print_targets, write_result

from loadmaster.common.clock import FakeClock
from loadmaster.gateway.calls import InferenceCall
from loadmaster.gateway.held_credits import HeldCredits
from loadmaster.gateway.local_share import LocalShare
from loadmaster.v1 import scheduler_pb2

MODEL = "sleep"
RUN_MS = 10.0
SIZES = (10, 100, 1_000, 10_000)
CALLS_EACH = 5  # a cadence is trusted after 3 gaps
TIMED = 2_000  # holds() calls timed per size
TARGET_US_AT_1000 = 50.0
TARGET_GROWTH = 4.0


class _Scheduler:
    """The share reports its depth to the scheduler session: nobody listens here."""

    connected = True
    session = 1

    def report_local_depth(self, *_: Any) -> None:
        pass


def _share(clock: FakeClock) -> LocalShare[Any]:
    share: LocalShare[Any] = LocalShare(
        clock=clock,
        scheduler=_Scheduler(),  # type: ignore[arg-type]
        credits=HeldCredits(clock),
        take=lambda _model: None,
        start=lambda *_: True,
        to_scheduler=lambda _pending: None,
        fail=lambda _pending, _error: None,
    )
    spec = scheduler_pb2.LocalQueue(strategy="model_deadline", stage=1, latency_budget_ms=50.0)
    share.configure(MODEL, spec, 1_000.0)
    for _ in range(10):  # steady: every run takes RUN_MS, 1 ms there and back
        share.served(MODEL, RUN_MS, 1.0)
    return share


def _call(request_id: str, client: str, priority: int) -> InferenceCall:
    return InferenceCall(
        request_id=request_id, client_id=client, model_id=MODEL, inputs=[], payload=b"", priority=priority
    )


def measure(clients: int) -> dict[str, Any]:
    clock = FakeClock()
    share = _share(clock)
    period = clients * RUN_MS / 1000.0
    step = period / clients
    for round_ in range(CALLS_EACH):  # each client's calls, in the order they come
        for i in range(clients):
            call = _call(f"{i}-{round_}", f"robot-{i}", 0)
            share.started(call)
            share.ended(call)
            clock.advance(step)
    low = _call("low", "background", 2)
    started = time.perf_counter()
    for _ in range(TIMED):
        share.holds(low)
    us = (time.perf_counter() - started) / TIMED * 1e6
    return {"clients": clients, "period_ms": round(period * 1000, 1), "us_per_hold": round(us, 2)}


def main() -> None:
    rows = []
    for clients in SIZES:
        row = measure(clients)
        rows.append(row)
        print(
            f"{clients:>6,} urgent clients (each every {row['period_ms']:,} ms): "
            f"{row['us_per_hold']:8.2f} us per hold",
            flush=True,
        )
    by_size = {r["clients"]: r["us_per_hold"] for r in rows}
    growth = by_size[10_000] / by_size[10]
    targets = [
        {
            "name": "holds() at 1,000 urgent clients",
            "measured": by_size[1_000],
            "target": f"<= {TARGET_US_AT_1000:g}",
            "unit": "us",
            "met": by_size[1_000] <= TARGET_US_AT_1000,
        },
        {
            "name": "holds() at 10,000 urgent clients against 10",
            "measured": round(growth, 2),
            "target": f"<= {TARGET_GROWTH:g}",
            "unit": "x",
            "met": growth <= TARGET_GROWTH,
        },
    ]
    print_targets(targets, write_result("gateway_holds", {"targets": targets, "runs": rows}))


if __name__ == "__main__":
    main()
