"""bench/llm_serving.py's bookkeeping: stream summaries, the issue's targets from both sides,
the lines in bench/RESULTS.md, and a failing side reported instead of crashing the bench."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import llm_serving  # noqa: E402
import report  # noqa: E402
from _llm_client import StreamRecord, Target, Window, combine, summarize  # noqa: E402


def _record(
    ttft_s: float | None, gaps: tuple[float, ...], tokens: int, error: str | None = None
) -> StreamRecord:
    return StreamRecord(0.0, ttft_s, gaps, tokens, error)


def test_summarize_counts_usage_tokens_and_times_only_the_streams_that_worked() -> None:
    records = [
        _record(0.010, (0.002, 0.004), 3),
        _record(0.030, (0.006,), 2),
        _record(None, (), 0, "APIConnectionError: refused"),
    ]
    summary = summarize(records, wall_s=0.5)
    assert summary["requests"] == 3
    assert summary["failed"] == 1
    assert summary["first_error"] == "APIConnectionError: refused"
    assert summary["output_tokens"] == 5
    assert summary["output_tokens_per_s"] == 10.0
    assert summary["time_to_first_token"]["count"] == 2
    assert summary["time_to_first_token"]["p50_ms"] == 20.0
    assert summary["inter_token_latency"]["count"] == 3
    assert summary["inter_token_latency"]["max_ms"] == 6.0
    # (0.002 + 0.004) / 2 and 0.006 / 1: per stream, not per gap
    assert summary["time_per_output_token"]["count"] == 2
    assert summary["time_per_output_token"]["p50_ms"] == 4.5


def test_windows_of_one_concurrency_combine_into_tokens_over_their_summed_wall_time() -> None:
    first = Window((_record(0.01, (0.002,), 2), _record(0.02, (0.004,), 2)), wall_s=0.1, client_cpu_s=0.01)
    second = Window((_record(0.03, (0.006,), 2), _record(None, (), 0, "boom")), wall_s=0.4, client_cpu_s=0.03)
    run = combine(16, [first, second])
    assert run["concurrency"] == 16 and run["windows"] == 2
    assert run["output_tokens"] == 6 and run["output_tokens_per_s"] == 12.0  # 6 tokens / 0.5 s
    assert run["window_tokens_per_s"] == [40.0, 5.0]
    assert run["failed"] == 1 and run["time_to_first_token"]["count"] == 3
    assert run["client_cpu_us_per_token"] == pytest.approx(40000 / 6, abs=0.1)


def _run(concurrency: int, tokens_per_s: float, ttft_p50_ms: float) -> dict[str, object]:
    return {
        "concurrency": concurrency,
        "output_tokens_per_s": tokens_per_s,
        "failed": 0,
        "time_to_first_token": {"p50_ms": ttft_p50_ms, "p99_ms": ttft_p50_ms * 3},
        "inter_token_latency": {"p50_ms": 1.5, "p99_ms": 9.0},
        "time_per_output_token": {"p50_ms": 2.0, "p99_ms": 4.0},
    }


def _side(c1_ttft: float, c16: float, c64: float, ratio: float | None) -> dict[str, object]:
    side: dict[str, object] = {
        "ok": True,
        "runs": [_run(1, 400.0, c1_ttft), _run(16, c16, 50.0), _run(64, c64, 200.0)],
    }
    if ratio is not None:
        side["priority"] = {
            "background_streams": 64,
            "idle_ttft": {"p50_ms": 10.0, "p99_ms": 12.0},
            "loaded_ttft": {"p50_ms": 20.0, "p99_ms": 10.0 * ratio},
            "ratio_loaded_p99_to_idle_p50": ratio,
        }
    return side


def test_targets_compare_the_two_sides_and_judge_each_goal() -> None:
    sides = {
        "reference": _side(c1_ttft=10.0, c16=2000.0, c64=3000.0, ratio=40.0),
        "loadmaster": _side(c1_ttft=16.0, c16=2200.0, c64=2700.0, ratio=2.5),
    }
    sides["loadmaster"]["runs"][2]["time_to_first_token"]["p99_ms"] = 540.0  # type: ignore[index]
    rows = {row["name"]: row for row in llm_serving.targets(sides)}
    c16 = rows["output tokens/s at concurrency 16 vs transformers serve"]
    c64 = rows["output tokens/s at concurrency 64 vs transformers serve"]
    ttft = rows["time to first token p50 at concurrency 1 vs transformers serve"]
    tail = rows["time to first token p99 at concurrency 64 vs transformers serve"]
    priority = rows["priority-0 time to first token p99 under 64 priority-2 streams / idle p50"]
    assert (c16["measured"], c16["met"]) == (1.1, True)
    assert (c64["measured"], c64["met"]) == (0.9, False)
    assert (tail["measured"], tail["met"]) == (0.9, True)  # 540 / 600
    assert (ttft["measured"], ttft["met"]) == (1.6, False)  # 16 / 10 > 1.5
    assert (priority["measured"], priority["met"]) == (2.5, None)  # shown; llm_scheduling judges it


def test_a_failed_side_makes_every_target_not_met_instead_of_crashing() -> None:
    sides = {
        "reference": _side(c1_ttft=10.0, c16=2000.0, c64=3000.0, ratio=40.0),
        "loadmaster": {"ok": False, "error": "the first request failed: NotFoundError: Error code: 404"},
    }
    rows = llm_serving.targets(sides)
    assert len(rows) == 5
    assert all(row["measured"] == "n/a" and row["met"] in (False, None) for row in rows)
    summary = llm_serving.table(sides)
    assert summary["loadmaster"] == {"ok": False, "error": sides["loadmaster"]["error"]}
    assert summary["reference"]["concurrency_16"].startswith("2,000.0 output tokens/s; TTFT p50 50.0")
    assert summary["reference"]["priority"].endswith("ratio 40.0x")


def test_results_md_lists_each_side_and_phase(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    sides = {
        "reference": _side(c1_ttft=10.0, c16=2000.0, c64=3000.0, ratio=40.0),
        "loadmaster": {"ok": False, "error": "boom"},
    }
    result = {
        "benchmark": "llm_serving",
        "summary": llm_serving.table(sides),
        "targets": llm_serving.targets(sides),
        "sides": [{"name": n, **s} for n, s in sides.items()],
    }
    (tmp_path / "llm_serving.json").write_text(json.dumps(result))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    text = report.render()
    assert "| summary.reference.concurrency_64 | 3,000.0 output tokens/s;" in text
    assert "| summary.loadmaster.error | boom |" in text
    assert (
        "| llm_serving | output tokens/s at concurrency 16 vs transformers serve | n/a x | >= 1.1 x | **no** |"
        in text
    )


def test_a_side_that_does_not_start_is_reported_and_the_others_still_run() -> None:
    @contextmanager
    def broken() -> Iterator[Target]:
        raise RuntimeError("`transformers serve` exited with 1")
        yield  # pragma: no cover

    args = argparse.Namespace(side_budget_s=5.0, windows=1, concurrency=[], probes=0)
    sides = llm_serving.run_sides({"reference": broken}, args)
    assert sides == {
        "reference": {
            "ok": False,
            "error": "could not start: RuntimeError: `transformers serve` exited with 1",
        }
    }
