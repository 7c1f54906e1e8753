"""bench/chaos.py's bookkeeping (what a scenario cost, from the background clients' records and
the auditor's samples) and its table in bench/RESULTS.md (bench/report.py)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import report  # noqa: E402
from _chaos_report import Window, _measure, _targets  # noqa: E402
from _chaos_scenarios import Outcome, Scenario  # noqa: E402
from _chaos_suite import Sample  # noqa: E402

NAN = math.nan


def _window() -> Window:
    scenario = Scenario("kill-worker", lambda up, bg: Outcome(), "fault")
    return Window(scenario, start=100.0, fault=101.0, end=110.0, recovered=True)


def test_measure_counts_unanswered_and_recovery_after_the_last_failure() -> None:
    records = [
        ("a:0", 99.0, 99.01, "ok"),  # before the window: not counted
        ("a:1", 100.5, 100.51, "ok"),
        ("a:2", 101.2, 101.21, "ok"),  # answered right after the fault: not yet "recovered"
        ("a:3", 101.5, 103.0, "unavailable"),
        ("a:4", 102.0, NAN, "none"),  # never answered
        ("a:5", 103.5, 104.25, "ok"),  # the first OK after the last failure
        ("a:6", 104.0, 104.3, "ok"),
    ]
    samples = [
        Sample(100.1, 7, 100.0, 32.0, 16384.0),
        Sample(102.0, 7, 150.0, 20000.0, 16384.0),  # promised more than the GPU has
        Sample(103.0, 8, 90.0, 32.0, 16384.0),  # a new gateway process: its own baseline
        Sample(104.0, 8, 95.0, None, None),
    ]
    row = _measure(_window(), records, samples)
    assert row["sent"] == 6 and row["unanswered"] == 1
    assert row["error_replies"] == {"unavailable": 1}
    assert row["recovered_s"] == 3.25
    assert row["worst_latency_ms"] == 1500.0
    assert row["gateway_rss_growth_mb"] == 50.0
    assert row["promised_over_capacity"] is True and row["audit_samples"] == 3


def test_targets_and_report_table() -> None:
    row = _measure(_window(), [("a:1", 101.5, 101.6, "ok")], [])
    skipped = {"scenario": "flushall", "kind": "-", "skipped": "run budget spent"}
    targets = {t["name"]: t for t in _targets([row, skipped], payload_limit_mb=64)}
    assert targets["requests without a reply, all scenarios"]["met"] is True
    assert targets["serving again after each fault (worst)"]["measured"] == "0.6 s (kill-worker)"
    lines = report._scenario_table([row, skipped])
    assert lines[0].startswith("| scenario | sent | no reply | serving again (s)")
    assert lines[2].startswith("| kill-worker | 1 | 0 | 0.6 |")
    assert lines[3] == "| flushall | skipped: run budget spent |"
