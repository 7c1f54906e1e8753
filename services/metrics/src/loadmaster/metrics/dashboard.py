"""What the dashboard (`GET /`) plots, as one JSON document (`GET /api/dashboard`).

Time runs in `step_s` buckets over the last `window_s` seconds of this service's monotonic
clock (the clock windows are measured on), oldest first; each series is one value per
bucket, `null` where a bucket has nothing to show:

| chart | series | per bucket |
|---|---|---|
| latency per model | `e2e_latency_ms{model}` (gateway, every result code) | p50 / p95 / p99 of its samples |
| throughput | `requests{model}` (gateway) | answered requests per second |
| deadline misses | `requests{model, code="expired"}` (gateway) | expired answers per second |
| queue depth | `queue_depth{model}` (scheduler gauge) | the highest reading in the bucket, else the last before |
| GPU memory | `lease_mb{node, gpu}`, `free_mb{node, gpu}` (gpu-broker gauges) | the last reading |
| tokens/s per model (generative) | `output_tokens{model}` (model-pool) | tokens generated per second |
| time to first token per model | `time_to_first_token_ms{model}` (gateway) | p50 / p95 of its samples |

Each generative model's `summary` also has its scheduling over the last `summary_s`
(docs/generation-scheduling.md), from the model pool: tokens/s per tenant
(`tenant_output_tokens`, `tenant_prompt_tokens{model, tenant}`, counted when a stream ends),
the wait from arrival at the worker to the first token per priority
(`generation_queue_wait_ms{model, priority}`: p50 / p95), the pauses and what became of the
paused sequences' KV cache (`preemptions`, `yields`, `resumptions`, `kv_kept`,
`kv_recomputed`: counts), and the largest gap between backlogged tenants' virtual counters
(`tenant_counter_gap`, the last reading).

`summary` holds the same per model over the last `summary_s` seconds. Model states per
worker come from the scheduler's `ListWorkers` (the caller passes them in), else from the
model-pool's `slot_state` samples. Pure code over `Windows`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from loadmaster.metrics.windows import Series, Windows

__all__ = ["SlotRow", "WorkerRow", "snapshot"]

_UNKNOWN_MODEL = "(unknown)"
_FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class SlotRow:
    model: str
    state: str
    inflight: int = 0
    vram_mb: int = 0


@dataclass(frozen=True, slots=True)
class WorkerRow:
    worker_id: str
    slots: tuple[SlotRow, ...]


_PAUSE_COUNTS = ("preemptions", "yields", "resumptions", "kv_kept", "kv_recomputed")


def _scheduling(windows: Windows, model: str, cutoff: float, summary_s: float) -> dict[str, Any]:
    """A generative model's scheduling since `cutoff` (the module docstring's last table)."""
    tenants: dict[str, dict[str, float]] = {}
    pairs = (("tenant_output_tokens", "output_tokens_per_s"), ("tenant_prompt_tokens", "prompt_tokens_per_s"))
    for name, key in pairs:
        for series in windows.series(name):
            if _label(series, "model") != model:
                continue
            total = float(series.values_since(cutoff).sum())
            tenants.setdefault(_label(series, "tenant"), {})[key] = round(total / summary_s, 3)
    waits: dict[str, dict[str, float | None]] = {}
    for series in windows.series("generation_queue_wait_ms"):
        if _label(series, "model") != model:
            continue
        values = series.values_since(cutoff)
        if values.size:
            waits[_label(series, "priority")] = {
                "p50_ms": _finite(float(np.percentile(values, 50))),
                "p95_ms": _finite(float(np.percentile(values, 95))),
            }
    counts = {
        name: sum(
            float(s.values_since(cutoff).sum()) for s in windows.series(name) if _label(s, "model") == model
        )
        for name in _PAUSE_COUNTS
    }
    gaps = [s.last_value for s in windows.series("tenant_counter_gap") if _label(s, "model") == model]
    return {
        "tenants": dict(sorted(tenants.items())),
        "wait_to_first_token_by_priority": dict(sorted(waits.items())),
        **{name: int(value) for name, value in counts.items()},
        "tenant_counter_gap": _finite(max(gaps)) if gaps else None,
    }


def _label(series: Series, key: str) -> str:
    for name, value in series.labels:
        if name == key:
            return value
    return ""


def _finite(value: float) -> float | None:
    return round(value, 4) if math.isfinite(value) else None


class _Buckets:
    def __init__(self, *, now: float, window_s: float, step_s: float) -> None:
        self.count = max(1, math.ceil(window_s / step_s))
        self.step_s = step_s
        self.start = now - self.count * step_s
        self.ends = self.start + step_s * np.arange(1, self.count + 1)

    def index(self, received: _FloatArray) -> npt.NDArray[np.int64]:
        """Bucket index of each receive time (bucket i holds (end[i] - step, end[i]]); -1 outside
        the window."""
        index = np.ceil((received - self.start) / self.step_s).astype(np.int64) - 1
        index[(index < 0) | (index >= self.count)] = -1
        return index


def _gather(series: Iterable[Series], cutoff: float | None) -> tuple[_FloatArray, _FloatArray]:
    received: list[_FloatArray] = []
    values: list[_FloatArray] = []
    for one in series:
        r, v = one.window_since(cutoff)
        received.append(r)
        values.append(v)
    if not received:
        return np.empty(0), np.empty(0)
    return np.concatenate(received), np.concatenate(values)


def _rate(received: _FloatArray, values: _FloatArray, buckets: _Buckets) -> list[float]:
    index = buckets.index(received)
    keep = index >= 0
    sums = np.bincount(index[keep], weights=values[keep], minlength=buckets.count)
    return np.round(sums / buckets.step_s, 4).tolist()  # type: ignore[no-any-return]


def _percentiles(
    received: _FloatArray, values: _FloatArray, buckets: _Buckets
) -> dict[str, list[float | None]]:
    """p50/p95/p99 per bucket (linear interpolation, as `numpy.percentile`), vectorized over
    buckets: one sort by (bucket, value), then index arithmetic."""
    out: dict[str, list[float | None]] = {}
    index = buckets.index(received)
    keep = index >= 0
    index, values = index[keep], values[keep]
    if not index.size:
        return {name: [None] * buckets.count for name in ("p50", "p95", "p99")}
    order = np.lexsort((values, index))
    index, values = index[order], values[order]
    starts = np.flatnonzero(np.r_[True, index[1:] != index[:-1]])
    counts = np.diff(np.r_[starts, index.size])
    present = index[starts]
    last = starts + counts - 1
    for name, q in (("p50", 0.50), ("p95", 0.95), ("p99", 0.99)):
        position = starts + (counts - 1) * q
        low = np.floor(position).astype(np.int64)
        high = np.minimum(low + 1, last)
        found = values[low] + (values[high] - values[low]) * (position - low)
        column: list[float | None] = [None] * buckets.count
        for bucket, value in zip(present.tolist(), np.round(found, 4).tolist(), strict=True):
            column[bucket] = value if math.isfinite(value) else None
        out[name] = column
    return out


def _gauge(series: Series, buckets: _Buckets, *, peak: bool = False) -> list[float | None]:
    """Per bucket, the gauge's last value received up to the bucket's end (carried forward
    through buckets without readings); with `peak`, the highest reading inside a bucket that has
    several, so a queue that filled and drained within a second still shows."""
    received, values = series.window_since(None)
    if not received.size:
        return [None] * buckets.count
    order = np.argsort(received, kind="stable")
    received, values = received[order], values[order]
    positions = np.searchsorted(received, buckets.ends, side="right") - 1
    out = [None if p < 0 else _finite(float(values[p])) for p in positions]
    if peak:
        index = buckets.index(received)
        for bucket, value in zip(index.tolist(), values.tolist(), strict=True):
            current = out[bucket] if bucket >= 0 else None
            if bucket >= 0 and current is not None and value > current:
                out[bucket] = _finite(value)
    return out


def _summary(
    windows: Windows, model: str, by_name: dict[str, list[Series]], summary_s: float
) -> dict[str, float | None]:
    cutoff = windows.now() - summary_s
    _, latencies = _gather(by_name["e2e_latency_ms"], cutoff)
    total = ok = expired = 0.0
    for series in by_name["requests"]:
        count = float(series.values_since(cutoff).sum())
        total += count
        code = _label(series, "code")
        ok += count if code == "ok" else 0.0
        expired += count if code == "expired" else 0.0
    depth = max((s.last_value for s in by_name["queue_depth"] if len(s)), default=None)
    p50, p95, p99 = np.percentile(latencies, (50, 95, 99)) if latencies.size else (math.nan,) * 3
    return {
        "p50_ms": _finite(float(p50)),
        "p95_ms": _finite(float(p95)),
        "p99_ms": _finite(float(p99)),
        "throughput_rps": round(total / summary_s, 3),
        "errors": round(total - ok),
        "deadline_misses": round(expired),
        "queue_depth": depth,
    }


def _states_from_samples(windows: Windows) -> list[WorkerRow]:
    """Slot states from `slot_state` (1 = in this state), one row per reporting service."""
    by_worker: dict[str, dict[str, str]] = {}
    for series in windows.series("slot_state"):
        if len(series) and series.last_value >= 1:
            worker = _label(series, "worker") or _label(series, "service") or "model-pool"
            by_worker.setdefault(worker, {})[_label(series, "model")] = _label(series, "state").upper()
    return [
        WorkerRow(worker, tuple(SlotRow(model, state) for model, state in sorted(slots.items())))
        for worker, slots in sorted(by_worker.items())
    ]


def snapshot(
    windows: Windows,
    *,
    window_s: float = 120.0,
    step_s: float = 1.0,
    summary_s: float = 10.0,
    workers: Sequence[WorkerRow] | None = None,
) -> dict[str, Any]:
    """The dashboard's document (JSON-ready). `workers`: the scheduler's view, when reachable."""
    if not (window_s > 0 and step_s > 0 and summary_s > 0) or window_s / step_s > 3600:
        raise ValueError("window_s, step_s and summary_s must be > 0, with at most 3600 steps")
    now = windows.now()
    buckets = _Buckets(now=now, window_s=window_s, step_s=step_s)
    cutoff = buckets.start

    per_model: dict[str, dict[str, list[Series]]] = {}
    for name in ("e2e_latency_ms", "requests", "queue_depth"):
        for series in windows.series(name):
            model = _label(series, "model")
            if model and model != _UNKNOWN_MODEL:
                entry = per_model.setdefault(model, {"e2e_latency_ms": [], "requests": [], "queue_depth": []})
                entry[name].append(series)

    models: dict[str, Any] = {}
    for model, by_name in sorted(per_model.items()):
        latency = _percentiles(*_gather(by_name["e2e_latency_ms"], cutoff), buckets)
        throughput = _rate(*_gather(by_name["requests"], cutoff), buckets)
        expired = [s for s in by_name["requests"] if _label(s, "code") == "expired"]
        misses = _rate(*_gather(expired, cutoff), buckets)
        depth: list[float | None] = [None] * buckets.count
        for series in by_name["queue_depth"]:  # one scheduler: one series; several: their sum
            for i, value in enumerate(_gauge(series, buckets, peak=True)):
                if value is not None:
                    depth[i] = (depth[i] or 0.0) + value
        models[model] = {
            **latency,
            "throughput_rps": throughput,
            "deadline_misses_per_s": misses,
            "queue_depth": depth,
            "summary": _summary(windows, model, by_name, summary_s),
        }

    generative: dict[str, Any] = {}
    tokens_by_model: dict[str, list[Series]] = {}
    for series in windows.series("output_tokens"):
        tokens_by_model.setdefault(_label(series, "model"), []).append(series)
    ttft_by_model: dict[str, list[Series]] = {}
    for series in windows.series("time_to_first_token_ms"):
        ttft_by_model.setdefault(_label(series, "model"), []).append(series)
    for model in sorted(set(tokens_by_model) | set(ttft_by_model)):
        ttft = _percentiles(*_gather(ttft_by_model.get(model, []), cutoff), buckets)
        summary_cutoff = now - summary_s
        tokens_now = sum(float(s.values_since(summary_cutoff).sum()) for s in tokens_by_model.get(model, []))
        _, recent_ttft = _gather(ttft_by_model.get(model, []), summary_cutoff)
        generative[model] = {
            "tokens_per_s": _rate(*_gather(tokens_by_model.get(model, []), cutoff), buckets),
            "ttft_p50_ms": ttft["p50"],
            "ttft_p95_ms": ttft["p95"],
            "summary": {
                "tokens_per_s": round(tokens_now / summary_s, 3),
                "ttft_p50_ms": _finite(float(np.percentile(recent_ttft, 50))) if recent_ttft.size else None,
                "ttft_p95_ms": _finite(float(np.percentile(recent_ttft, 95))) if recent_ttft.size else None,
                **_scheduling(windows, model, summary_cutoff, summary_s),
            },
        }

    gpus: dict[str, Any] = {}
    for name in ("lease_mb", "free_mb"):
        for series in windows.series(name):
            gpu = f"{_label(series, 'node') or '?'}/gpu{_label(series, 'gpu') or '?'}"
            gpus.setdefault(gpu, {})[name] = _gauge(series, buckets)
            gpus[gpu][f"{name}_now"] = _finite(series.last_value)

    rows = list(workers) if workers else _states_from_samples(windows)
    return {
        "window_s": window_s,
        "step_s": step_s,
        "summary_s": summary_s,
        "t": [round(float(end - now), 3) for end in buckets.ends],  # seconds relative to now
        "models": models,
        "generative": generative,
        "gpus": dict(sorted(gpus.items())),
        "workers": [
            {"worker_id": row.worker_id, "slots": [asdict(slot) for slot in row.slots]} for row in rows
        ],
    }
