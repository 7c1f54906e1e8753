"""Render bench/RESULTS.md from bench/results/*.json.

A result may carry `targets`: a list of {name, measured, target, unit, met}; those rows make
the summary table. A result with `scenarios` (a list of rows, `make chaos`) gets them as one
table. A result with `tables` ({title: list of rows, each a dict of column -> value}) gets each
as a table of its own (compare_inferential's throughput curve). Everything else scalar at the
top level is listed per benchmark.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "bench" / "RESULTS.md"


def _scalars(data: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for key, value in data.items():
        if key in {"benchmark", "when", "machine", "targets", "tables"}:
            continue
        if isinstance(value, dict) and len(value) <= 12:
            rows += _scalars(value, f"{prefix}{key}.")
        elif isinstance(value, str | int | float | bool):
            rows.append((f"{prefix}{key}", value))
    return rows


_SCENARIO_COLUMNS = (
    ("scenario", "scenario"),
    ("sent", "sent"),
    ("unanswered", "no reply"),
    ("recovered_s", "serving again (s)"),
    ("worst_latency_ms", "worst latency (ms)"),
    ("gateway_rss_growth_mb", "gateway RSS growth (MB)"),
    ("promised_over_capacity", "promised > capacity"),
    ("refused", "refused"),
    ("detail", "what happened"),
)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items()) or "-"
    return str(value).replace("|", "\\|")


def _scenario_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| " + " | ".join(title for _, title in _SCENARIO_COLUMNS) + " | error replies |",
        "|" + "---|" * (len(_SCENARIO_COLUMNS) + 1),
    ]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['scenario']} | skipped: {row['skipped']} |")
            continue
        cells = [_cell(row.get(key)) for key, _ in _SCENARIO_COLUMNS]
        lines.append("| " + " | ".join(cells) + f" | {_cell(row.get('error_replies'))} |")
    return lines


def _rows_table(title: str, rows: list[dict[str, Any]]) -> list[str]:
    """A titled table: one column per key of the first row."""
    if not rows:
        return []
    columns = list(rows[0])
    lines = [f"**{title}**", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(column)) for column in columns) + " |" for row in rows]
    return [*lines, ""]


def render() -> str:
    # A result names its benchmark; one written without the harness is named after its file.
    results = [
        {"benchmark": path.stem, **json.loads(path.read_text())} for path in sorted(RESULTS.glob("*.json"))
    ]
    lines = ["# Benchmark results", ""]
    if results:
        machine = results[-1].get("machine", {})
        lines += [
            "Produced by `make bench` (`python bench/run_all.py`); each file in `bench/results/` holds the",
            "raw numbers. Machine of the latest run: "
            + ", ".join(f"{k} {v}" for k, v in machine.items())
            + ".",
            "",
        ]
    targets = [
        (r["benchmark"], t) for r in results if isinstance(r.get("targets"), list) for t in r["targets"]
    ]
    if targets:
        lines += ["## Targets", "", "| benchmark | target | measured | goal | met |", "|---|---|---|---|---|"]
        for bench, t in targets:
            unit = t.get("unit", "")
            met = "yes" if t.get("met") else "**no**"
            if "met" in t and t["met"] is None:
                met = "shown"  # a figure the benchmark prints but does not judge
            lines.append(f"| {bench} | {t['name']} | {t['measured']} {unit} | {t['target']} {unit} | {met} |")
        lines.append("")
    for r in results:
        lines += [f"## {r['benchmark']}", "", f"Run {r.get('when', '?')}.", ""]
        if isinstance(r.get("scenarios"), list):
            lines += [*_scenario_table(r["scenarios"]), ""]
        if isinstance(r.get("tables"), dict):
            for title, rows in r["tables"].items():
                lines += _rows_table(title, rows)
        rows = _scalars(r)
        if rows:
            lines += ["| value | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows[:40]]
        plots = sorted(RESULTS.glob(f"{r['benchmark']}*.png"))
        lines += [""] + [f"![{p.stem}](results/{p.name})" for p in plots] + [""]
    return "\n".join(lines) + "\n"


def main() -> int:
    OUT.write_text(render())
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
