"""bench/chaos.py's bookkeeping: what one scenario's window cost (`_measure`, from the
background clients' records and the auditor's samples) and the run's targets (`_targets`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from _chaos_scenarios import Outcome, Scenario
from _chaos_suite import Sample

TARGET_RECOVER_S = 5.0
TARGET_WORST_MS = 100.0


@dataclass
class Window:
    scenario: Scenario
    start: float
    fault: float
    end: float = 0.0
    outcome: Outcome = field(default_factory=Outcome)
    recovered: bool = False
    supervisor_alive: bool = True


def _measure(
    window: Window, records: list[tuple[str, float, float, str]], samples: list[Sample]
) -> dict[str, Any]:
    mine = [r for r in records if window.start <= r[1] < window.end]
    unanswered = [r for r in mine if np.isnan(r[2])]
    answered = [r for r in mine if not np.isnan(r[2])]
    errors: dict[str, int] = {}
    for r in answered:
        if r[3] != "ok":
            errors[r[3]] = errors.get(r[3], 0) + 1
    # Serving again: the first OK reply to a request sent after the last failed one (an error
    # reply or none at all) among those sent since the fault.
    since = [r for r in mine if r[1] >= window.fault]
    failed = [r[1] for r in since if np.isnan(r[2]) or r[3] != "ok"]
    after_failures = max(failed, default=window.fault)
    ok_after = sorted(r[2] for r in since if r[1] >= after_failures and r[3] == "ok" and not np.isnan(r[2]))
    recovered_s = round(ok_after[0] - window.fault, 3) if ok_after else None
    worst_ms = round(max((r[2] - r[1] for r in answered), default=0.0) * 1000, 1)
    growth: float | None = None
    in_window = [s for s in samples if window.start <= s.t < window.end and s.gateway_rss_mb is not None]
    by_pid: dict[int, list[float]] = {}
    for s in in_window:
        by_pid.setdefault(s.gateway_pid or 0, []).append(s.gateway_rss_mb or 0.0)
    if by_pid:
        growth = round(max(max(v) - v[0] for v in by_pid.values()), 1)
    audited = [s for s in samples if window.start <= s.t < window.end and s.promised_mb is not None]
    over = [s for s in audited if s.capacity_mb and (s.promised_mb or 0) > s.capacity_mb]
    return {
        "scenario": window.scenario.name,
        "kind": window.scenario.kind,
        "detail": window.outcome.detail,
        "sent": len(mine),
        "unanswered": len(unanswered),
        "error_replies": errors,
        "recovered_s": recovered_s,
        "recovered_within_timeout": window.recovered,
        "worst_latency_ms": worst_ms,
        "gateway_rss_growth_mb": growth,
        "promised_over_capacity": bool(over),
        "max_promised_mb": max((s.promised_mb or 0.0 for s in audited), default=None),
        "audit_samples": len(audited),
        "refused": window.outcome.refused,
        "supervisor_alive": window.supervisor_alive,
        **window.outcome.extra,
    }


def _targets(rows: list[dict[str, Any]], payload_limit_mb: float) -> list[dict[str, Any]]:
    ran = [r for r in rows if "skipped" not in r]
    faults = [r for r in ran if r["kind"] == "fault"]
    slowest = max(
        faults, key=lambda r: r["recovered_s"] if r["recovered_s"] is not None else float("inf"), default=None
    )
    worst_recover = None if slowest is None else slowest["recovered_s"]
    if slowest is None:
        recover_text = "-"
    elif worst_recover is None:
        recover_text = f"never ({slowest['scenario']})"
    else:
        recover_text = f"{worst_recover} s ({slowest['scenario']})"
    big = [r for r in ran if r["scenario"].startswith("max-size")]
    memory = [r for r in ran if r["kind"] == "load" and r["gateway_rss_growth_mb"] is not None]
    trust = [r for r in ran if r["kind"] == "trust"]
    unanswered = sum(r["unanswered"] for r in ran)
    targets = [
        {"name": "requests without a reply, all scenarios", "measured": unanswered, "target": 0,
         "unit": "", "met": unanswered == 0},
        {"name": "serving again after each fault (worst)",
         "measured": recover_text,
         "target": f"<= {TARGET_RECOVER_S:g} s", "unit": "",
         "met": worst_recover is not None and worst_recover <= TARGET_RECOVER_S},
        {"name": "promised memory over capacity (audited)",
         "measured": sum(r["promised_over_capacity"] for r in ran), "target": 0, "unit": "scenarios",
         "met": not any(r["promised_over_capacity"] for r in ran)},
    ]  # fmt: skip
    if big:
        worst = max(r["worst_latency_ms"] for r in big)
        targets.append({"name": "background worst latency during a max-size request", "measured": worst,
                        "target": f"<= {TARGET_WORST_MS:g}", "unit": "ms", "met": worst <= TARGET_WORST_MS})  # fmt: skip
    if memory:
        growth = max(r["gateway_rss_growth_mb"] for r in memory)
        targets.append({"name": "gateway RSS growth in memory scenarios", "measured": growth,
                        "target": f"< {2 * payload_limit_mb:g}", "unit": "MB",
                        "met": growth < 2 * payload_limit_mb})  # fmt: skip
    if trust:
        refused = sum(1 for r in trust if r["refused"])
        targets.append({"name": "internal-trust scenarios refused", "measured": f"{refused}/{len(trust)}",
                        "target": f"{len(trust)}/{len(trust)}", "unit": "", "met": refused == len(trust)})  # fmt: skip
    return targets
