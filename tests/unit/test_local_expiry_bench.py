"""bench/local_expiry.py's pure parts: which connection a timed request goes on (a reply must
never wait behind an earlier request with a later deadline), and the lateness summary."""

from __future__ import annotations

import math
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from local_expiry import lateness_summary, pick_connection  # noqa: E402


def test_pick_connection_keeps_deadlines_in_send_order_per_connection() -> None:
    assert pick_connection([-math.inf, -math.inf], 1.0) == 0  # all idle: the first
    assert pick_connection([0.5, 0.9, 2.0], 1.0) == 1  # the latest last deadline that is not later
    assert pick_connection([0.5, 1.0], 1.0) == 1  # an equal deadline keeps the order
    assert pick_connection([1.5, 2.0], 1.0) is None  # every connection would hold its reply back


def test_pick_connection_over_a_random_stream_never_inverts_a_connection() -> None:
    import random

    rng = random.Random(7)
    last = [-math.inf] * 16
    per_connection: list[list[float]] = [[] for _ in last]
    placed = 0
    for i in range(2000):
        deadline = i * 0.003 + rng.uniform(0.02, 0.2)
        chosen = pick_connection(last, deadline)
        if chosen is None:
            continue
        placed += 1
        last[chosen] = deadline
        per_connection[chosen].append(deadline)
    assert placed == 2000  # 16 connections carry ~37 outstanding uniform 20..200 ms timeouts
    assert all(d == sorted(d) for d in per_connection)


def test_lateness_summary_in_ms() -> None:
    summary = lateness_summary([0.001] * 98 + [0.02, -0.0005])
    assert summary["count"] == 100
    assert summary["p50_ms"] == 1.0
    assert summary["max_ms"] == 20.0
    assert summary["min_ms"] == -0.5
    assert summary["p99_ms"] is not None and 1.0 < summary["p99_ms"] < 20.0
    assert lateness_summary([])["p99_ms"] is None


def test_gateway_waited_ms_reads_the_expired_message() -> None:
    from local_expiry import gateway_waited_ms

    assert gateway_waited_ms("expired after waiting 39 ms for model 'sleep'") == 39.0
    assert gateway_waited_ms("expired after waiting 7.5 ms for model 'm'") == 7.5
    assert gateway_waited_ms("queue for model 'sleep' is full") is None


def test_late_bunches_groups_events_closer_than_the_gap() -> None:
    from local_expiry import late_bunches

    assert late_bunches([]) == []
    assert late_bunches([1.0, 1.01, 1.05, 2.0, 2.2, 2.21], gap_s=0.05) == [(1.0, 3), (2.0, 1), (2.2, 2)]
