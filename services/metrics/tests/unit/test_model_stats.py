from __future__ import annotations

import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.common.errors import InvalidArgumentError
from loadmaster.metrics.model_stats import BatchCount, DurationTotal, model_ids, model_statistics
from loadmaster.metrics.servicer import model_statistics_to_proto
from loadmaster.metrics.windows import Sample, Windows, label_set, observations_of


def sample(name: str, value: float, service: str, ts: int = 0, **labels: str) -> Sample:
    return Sample(name, value, label_set(labels, service=service), ts)


def traffic(model: str) -> list[Sample]:
    return [
        sample("requests", 1, "gateway", model=model, code="ok"),
        sample("requests", 1, "gateway", model=model, code="ok"),
        sample("requests", 1, "gateway", model=model, code="expired"),
        sample("e2e_latency_ms", 4.0, "gateway", model=model, code="ok"),
        sample("e2e_latency_ms", 6.0, "gateway", model=model, code="ok"),
        sample("e2e_latency_ms", 50.0, "gateway", model=model, code="expired"),
        sample("scheduling_wait_ms", 0.5, "scheduler", model=model),
        sample("scheduling_wait_ms", 1.5, "scheduler", model=model),
        sample("inference_latency_ms", 2.0, "model-pool", ts=111, model=model),
        sample("batch_size", 1, "model-pool", model=model),
        sample("inference_latency_ms", 3.0, "model-pool", ts=222, model=model),
        sample("batch_size", 2, "model-pool", model=model),
    ]


def test_statistics_sum_each_series_of_the_model() -> None:
    clock = FakeClock()
    windows = Windows(ring_size=100, clock=clock)
    windows.ingest(observations_of(traffic("double") + traffic("other")))
    windows.ingest(observations_of([sample("requests", 1, "gateway", model="(unknown)", code="not_found")]))

    stats = model_statistics(windows, "double")

    assert stats.success_count == 2
    assert stats.failure_count == 1
    assert stats.failures_by_code == {"expired": 1}
    assert stats.success == DurationTotal(2, 10.0)
    assert stats.failure == DurationTotal(1, 50.0)
    assert stats.queue == DurationTotal(2, 2.0)
    assert stats.compute == DurationTotal(2, 5.0)
    assert (stats.execution_count, stats.inference_count) == (2, 3)
    assert stats.batch_stats == (BatchCount(1, 1), BatchCount(2, 1))
    assert stats.last_inference_unix_ns == 222
    assert model_ids(windows) == ["double", "other"]

    message = model_statistics_to_proto(stats)
    assert message.success.total_ms == 10.0 and message.failures_by_code["expired"] == 1
    assert [(b.batch_size, b.count) for b in message.batch_stats] == [(1, 1), (2, 1)]


def test_totals_outlive_the_ring_and_windows_cut_old_samples() -> None:
    clock = FakeClock()
    windows = Windows(ring_size=100, clock=clock)
    for _ in range(150):  # more than the ring holds
        windows.ingest(observations_of([sample("requests", 1, "gateway", model="m", code="ok")]))
    assert model_statistics(windows, "m").success_count == 150

    clock.advance(60)
    windows.ingest(observations_of([sample("requests", 1, "gateway", model="m", code="ok")]))
    assert model_statistics(windows, "m", window_s=10).success_count == 1
    assert model_statistics(windows, "m").success_count == 151


def test_unknown_model_is_all_zero_and_hub_validates_window() -> None:
    from prometheus_client import CollectorRegistry

    from loadmaster.metrics.hub import MetricsHub

    hub = MetricsHub(ring_size=100, clock=FakeClock(), registry=CollectorRegistry(), process_metrics=False)
    hub.ingest(observations_of(traffic("double")), service="gateway")
    [nothing] = hub.model_statistics("nope", window_s=0)
    assert nothing.success_count == 0 and nothing.execution_count == 0 and nothing.batch_stats == ()
    assert [m.model_id for m in hub.model_statistics("", window_s=0)] == ["double"]
    with pytest.raises(InvalidArgumentError, match="window_s"):
        hub.model_statistics("", window_s=-1)
