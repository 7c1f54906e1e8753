"""Shared benchmark plumbing: start the suite (or use a running one), time things, write results."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
EXAMPLE_CONFIG = ROOT / "examples" / "loadmaster.yaml"


def machine() -> dict[str, Any]:
    import os

    import psutil

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
    }


def percentiles_ms(samples_s: list[float]) -> dict[str, float]:
    values = np.asarray(samples_s) * 1000
    return {
        "count": len(values),
        "p50_ms": round(float(np.percentile(values, 50)), 3),
        "p90_ms": round(float(np.percentile(values, 90)), 3),
        "p99_ms": round(float(np.percentile(values, 99)), 3),
        "mean_ms": round(float(values.mean()), 3),
        "max_ms": round(float(values.max()), 3),
    }


def write_result(name: str, result: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {
        "benchmark": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
    }
    payload.update(result)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def print_targets(targets: list[dict[str, Any]], path: Path) -> None:
    """One line per target (MET or MISS, the value measured, the target), then where they went."""
    for t in targets:
        print(
            f"{'MET ' if t['met'] else 'MISS'} {t['name']}: {t['measured']} (target {t['target']} {t['unit']})"
        )
    print(f"wrote {path}")


@contextmanager
def running_suite_handle(
    *, preload: list[str] | None = None, overrides: dict[str, Any] | None = None, workers: int = 1
) -> Iterator[Any]:
    """A suite started on free ports with the example config (a `loadmaster.cli.launcher.Suite`)."""
    import tempfile

    from loadmaster.cli.launcher import Suite, free_port_overrides

    merged = free_port_overrides()
    for section, values in (overrides or {}).items():
        if isinstance(values, dict):
            merged.setdefault(section, {}).update(values)
        else:
            merged[section] = values
    if preload is not None:
        merged["model_pool"]["preload"] = preload
    with tempfile.TemporaryDirectory(prefix="loadmaster-bench-") as logs:
        suite = Suite(EXAMPLE_CONFIG, overrides=merged, log_dir=Path(logs), workers=workers)
        print("starting the suite…", flush=True)
        suite.start(timeout_s=120)
        try:
            suite.wait_for_models(suite.settings.model_pool.preload, timeout_s=120)
            yield suite
        finally:
            suite.stop()


@contextmanager
def running_suite(edge: str | None, *, preload: list[str] | None = None) -> Iterator[str]:
    """Yield the edge address: `edge` when given, else a suite started on free ports."""
    if edge:
        yield edge
        return
    with running_suite_handle(preload=preload) as suite:
        yield suite.settings.gateway.edge.bind
