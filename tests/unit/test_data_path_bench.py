"""The data-path benchmarks' arithmetic: compare_inferential's "throughput never falls" check,
the CPU per request per process (idle_probe), the clients' start delay (_load), the collapsed-stack
counts of profile_data_path, and the curve table bench/report.py renders."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import compare_inferential  # noqa: E402
import profile_data_path  # noqa: E402
import report  # noqa: E402
from _load import start_delay_for  # noqa: E402
from idle_probe import cpu_us_per_request  # noqa: E402


def test_never_falls_allows_the_noise_ratio_and_no_more() -> None:
    assert compare_inferential.never_falls([100, 200, 190, 190]) == (True, 0.95)
    assert compare_inferential.never_falls([100, 200, 189, 400]) == (False, 0.945)
    assert compare_inferential.never_falls([100, 90], ratio=0.9) == (True, 0.9)


def test_never_falls_edge_cases() -> None:
    assert compare_inferential.never_falls([]) == (True, 1.0)
    assert compare_inferential.never_falls([500]) == (True, 1.0)
    assert compare_inferential.never_falls([100, 0]) == (False, 0.0)
    assert compare_inferential.never_falls([0, 50, 60])[0] is True  # a zero point, then a rise
    assert compare_inferential.never_falls([0, 0])[0] is False


def test_cpu_us_per_request_per_process_and_total() -> None:
    before = {"gateway": 10.0, "scheduler": 5.0, "redis": 1.0}
    after = {"gateway": 10.32, "scheduler": 5.21, "redis": 1.0}
    per = cpu_us_per_request(before, after, requests=1000)
    assert per == {"gateway": 320.0, "scheduler": 210.0, "redis": 0.0, "total": 530.0}


def test_cpu_us_per_request_without_requests_is_zero_not_a_division_error() -> None:
    assert cpu_us_per_request({"a": 1.0}, {"a": 2.0}, requests=0) == {"a": 0.0, "total": 0.0}


def test_start_delay_grows_with_clients_per_core_and_keeps_the_old_floor() -> None:
    assert start_delay_for(1, cpus=2) == 1.5
    assert start_delay_for(32, cpus=2) == pytest.approx(9.0)
    assert start_delay_for(32, cpus=16) < start_delay_for(32, cpus=2)


def test_parse_collapsed_counts_self_inclusive_and_threads() -> None:
    lines = [
        'process 12:"python -m loadmaster.gateway";thread (12): MainThread;main;loop;recv 6',
        'process 12:"python -m loadmaster.gateway";thread (12): MainThread;main;loop;send 3',
        "thread (14): ThreadPoolExecutor-0_0;worker;f;f 1",  # recursion counts once inclusively
        'process 13:"python -c',  # a command line with a newline continues on the next line
        'import a; a.run()";thread (15): ThreadPoolExecutor-0_0;worker;thread (x.py:3);g 2',
        "",
    ]
    profile = profile_data_path.parse_collapsed(lines)
    assert profile.samples == 12
    assert profile.self_counts == Counter({"recv": 6, "send": 3, "g": 2, "f": 1})
    assert profile.inclusive_counts["thread (x.py:3)"] == 2  # a function named thread is a frame
    assert profile.inclusive_counts["loop"] == 9
    assert profile.inclusive_counts["f"] == 1
    assert profile.inclusive_counts["worker"] == 3
    assert not any(frame.startswith(("thread (1", "process")) for frame in profile.inclusive_counts)
    assert profile.thread_counts == Counter({"MainThread": 9, "ThreadPoolExecutor-0_0": 3})


def test_parse_collapsed_leaves_native_waits_out_when_asked() -> None:
    lines = [
        "thread (1): MainThread;run_forever (loop.c:1);uv_run (core.c:464);epoll_wait (libc.so.6) 7",
        "thread (2): worker;_worker (x.py:1);PyThread_acquire_lock_timed (libpython);0x7f01 (libc.so.6) 2",
        "thread (1): MainThread;run_forever (loop.c:1);encode (tensors.py:9);memcpy (libc.so.6) 1",
    ]
    kept = profile_data_path.parse_collapsed(lines, drop_waiting=True)
    assert (kept.samples, kept.waiting) == (1, 9)
    assert kept.self_counts == Counter({"memcpy (libc.so.6)": 1})
    every = profile_data_path.parse_collapsed(lines)
    assert (every.samples, every.waiting) == (10, 0)


def test_top_frames_shares_skip_plumbing_and_estimate_us_per_request() -> None:
    counts = Counter({"run (asyncio/runners.py:118)": 10, "encode (tensors.py:1)": 5, "b": 3, "c": 2})
    rows = profile_data_path.top_frames(
        counts, 10, limit=2, us_per_request=200.0, skip=profile_data_path.PLUMBING
    )
    assert rows == [
        {"frame": "encode (tensors.py:1)", "percent": 50.0, "us_per_request": 100.0},
        {"frame": "b", "percent": 30.0, "us_per_request": 60.0},
    ]


def test_report_renders_the_curve_table() -> None:
    rows = [
        {"clients": 1, "Loadmaster req/s": 1500.0, "Inferential req/s": 3000.0},
        {"clients": 2, "Loadmaster req/s": 1700.0, "Inferential req/s": 4000.0},
    ]
    lines = report._rows_table("throughput curve", rows)
    assert lines[0] == "**throughput curve**"
    assert "| clients | Loadmaster req/s | Inferential req/s |" in lines
    assert "| 2 | 1700.0 | 4000.0 |" in lines
    assert report._rows_table("empty", []) == []


def test_skip_message_names_ptrace_only_when_that_is_the_cause() -> None:
    denied = profile_data_path._why_skipped({"gateway": "Permission denied (os error 13)"})
    assert "ptrace" in denied and "gateway: Permission denied" in denied
    other = profile_data_path._why_skipped({"gateway": "Failed to find python version"})
    assert "ptrace" not in other and other.startswith("py-spy failed on every process")
