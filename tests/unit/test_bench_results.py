"""The committed bench results render: every benchmark's targets carry the fields
bench/report.py reads, so RESULTS.md can be regenerated from them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import report  # noqa: E402

RESULTS = sorted((BENCH / "results").glob("*.json"))


def test_every_results_targets_have_the_shared_shape() -> None:
    checked, wrong = 0, []
    for path in RESULTS:
        data = json.loads(path.read_text())
        targets = data.get("targets") if isinstance(data, dict) else None
        for target in targets if isinstance(targets, list) else []:
            checked += 1
            if not {"name", "measured", "target", "met"} <= set(target):
                wrong.append(f"{path.name}: {target}")
    assert checked > 0
    assert wrong == []


def test_the_report_renders_every_committed_result() -> None:
    rendered = report.render()
    assert "| benchmark | target | measured | goal | met |" in rendered
    assert "llm_scheduling" in rendered
