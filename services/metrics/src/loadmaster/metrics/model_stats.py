"""Per-model statistics after Triton's statistics extension, computed from the series the
services already report (for the gateway's KServe `ModelStatistics`):

| statistic | series (labels) | reported by |
|---|---|---|
| success / failure counts | `requests{model, code}` (counter; code `ok` = success) | gateway |
| success / failure time | `e2e_latency_ms{model, code}` | gateway |
| queue time | `scheduling_wait_ms{model}` | scheduler |
| compute time, executions | `inference_latency_ms{model}` (one sample per engine call) | model-pool |
| inference count, batch stats | `batch_size{model}` (one sample per engine call) | model-pool |

With `window_s = 0` counts and totals cover everything since the metrics service started
(each series keeps a running count and sum beside its ring); with a window they cover the
samples received in it. Batch stats are counted over the samples still in the rings
(the last `ring_size` engine calls per series). Pure code over `Windows`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from loadmaster.metrics.windows import Series, Windows

__all__ = ["BatchCount", "DurationTotal", "ModelStatistics", "model_ids", "model_statistics"]

OK_CODE = "ok"
_MODEL_SERIES = ("requests", "e2e_latency_ms", "scheduling_wait_ms", "inference_latency_ms", "batch_size")
_UNKNOWN_MODEL = "(unknown)"  # the gateway's label for requests naming no known model


@dataclass(frozen=True, slots=True)
class DurationTotal:
    count: int = 0
    total_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class BatchCount:
    batch_size: int
    count: int


@dataclass(frozen=True, slots=True)
class ModelStatistics:
    model_id: str
    success_count: int = 0
    failure_count: int = 0
    failures_by_code: dict[str, int] = field(default_factory=dict)
    success: DurationTotal = DurationTotal()
    failure: DurationTotal = DurationTotal()
    queue: DurationTotal = DurationTotal()
    compute: DurationTotal = DurationTotal()
    inference_count: int = 0
    execution_count: int = 0
    batch_stats: tuple[BatchCount, ...] = ()
    last_inference_unix_ns: int = 0


def _label(series: Series, key: str) -> str:
    for name, value in series.labels:
        if name == key:
            return value
    return ""


def _totals(series: Series, cutoff: float | None) -> tuple[int, float]:
    """(samples, sum of values) of `series` in the window."""
    if cutoff is None:
        return series.total, series.value_total
    values = series.values_since(cutoff)
    return int(values.size), float(values.sum())


def model_ids(windows: Windows) -> list[str]:
    """Every model any of the statistics' series has been reported for."""
    found: set[str] = set()
    for name in _MODEL_SERIES:
        for series in windows.series(name):
            model = _label(series, "model")
            if model and model != _UNKNOWN_MODEL:
                found.add(model)
    return sorted(found)


def model_statistics(windows: Windows, model_id: str, *, window_s: float = 0.0) -> ModelStatistics:
    cutoff = windows.cutoff(window_s)

    def of(name: str) -> list[Series]:
        return [s for s in windows.series(name) if _label(s, "model") == model_id]

    success_count = 0
    failures: Counter[str] = Counter()
    for series in of("requests"):
        _, increments = _totals(series, cutoff)
        code = _label(series, "code")
        if code == OK_CODE:
            success_count += round(increments)
        elif increments:
            failures[code or "unknown"] += round(increments)

    success, failure = [0, 0.0], [0, 0.0]
    for series in of("e2e_latency_ms"):
        count, total = _totals(series, cutoff)
        into = success if _label(series, "code") == OK_CODE else failure
        into[0] += count
        into[1] += total

    def summed(name: str) -> tuple[int, float]:
        count, total = 0, 0.0
        for series in of(name):
            c, t = _totals(series, cutoff)
            count, total = count + c, total + t
        return count, total

    executions, requests_run = summed("batch_size")
    sizes: Counter[int] = Counter()
    for series in of("batch_size"):
        sizes.update(round(v) for v in series.values_since(cutoff).tolist())
    last = max((s.last_timestamp_unix_ns for s in of("inference_latency_ms") if len(s)), default=0)
    return ModelStatistics(
        model_id=model_id,
        success_count=success_count,
        failure_count=sum(failures.values()),
        failures_by_code=dict(sorted(failures.items())),
        success=DurationTotal(int(success[0]), float(success[1])),
        failure=DurationTotal(int(failure[0]), float(failure[1])),
        queue=DurationTotal(*summed("scheduling_wait_ms")),
        compute=DurationTotal(*summed("inference_latency_ms")),
        inference_count=round(requests_run),
        execution_count=executions,
        batch_stats=tuple(BatchCount(size, count) for size, count in sorted(sizes.items())),
        last_inference_unix_ns=last,
    )
