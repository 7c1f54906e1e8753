from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry

from loadmaster.common.clock import FakeClock
from loadmaster.common.errors import InvalidArgumentError
from loadmaster.metrics.hub import MetricsHub
from loadmaster.metrics.servicer import sample_to_proto, samples_from_batch, stats_to_proto
from loadmaster.metrics.windows import Sample, label_set
from loadmaster.v1 import metrics_pb2


def make_hub(**kwargs: int) -> MetricsHub:
    return MetricsHub(
        ring_size=1000, clock=FakeClock(), registry=CollectorRegistry(), process_metrics=False, **kwargs
    )


def own(hub: MetricsHub, name: str, **labels: str) -> float:
    value = hub.exposition.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_ingest_refuses_invalid_samples_and_counts() -> None:
    hub = make_hub(max_series=2)
    labels = label_set({"service": "gateway"})
    samples = [
        Sample("x", 1.0, labels),
        Sample("", 1.0, labels),
        Sample("x", math.nan, labels),
        Sample("x", math.inf, labels),
        Sample("y", 2.0, labels),
        Sample("z", 3.0, labels),  # a third series: over the limit
    ]

    assert hub.ingest(samples, service="gateway") == 2

    assert own(hub, "loadmaster_metrics_samples_accepted_total", service="gateway") == 2
    assert own(hub, "loadmaster_metrics_samples_refused_total", reason="invalid") == 3
    assert own(hub, "loadmaster_metrics_samples_refused_total", reason="series_limit") == 1
    assert own(hub, "loadmaster_metrics_series") == 2
    assert own(hub, "loadmaster_metrics_ingest_seconds_count") == 1


def test_queries_validate_arguments() -> None:
    hub = make_hub()
    with pytest.raises(InvalidArgumentError):
        hub.stats("", {}, window_s=0)
    with pytest.raises(InvalidArgumentError):
        hub.stats("x", {}, window_s=-1)
    assert hub.stats("x", {}, window_s=10).count == 0


async def test_ingest_feeds_windows_exposition_and_watchers() -> None:
    hub = make_hub()
    batch = metrics_pb2.ReportBatch(service="scheduler", instance="s-1")
    batch.samples.add(
        name="queue_depth", value=5, labels={"model": "m", "service": "spoofed"}, timestamp_unix_ns=7
    )
    with hub.watch(names=["queue_depth"], labels={"service": "scheduler"}) as watch:
        assert hub.ingest(samples_from_batch(batch), service=batch.service) == 1
        watched = await anext(aiter(watch))

    [latest] = hub.latest("", {"model": "m"})
    assert sample_to_proto(latest) == metrics_pb2.Sample(
        name="queue_depth", value=5, labels={"model": "m", "service": "scheduler"}, timestamp_unix_ns=7
    )
    assert watched == [latest]
    assert own(hub, "loadmaster_scheduler_queue_depth", model="m") == 5
    assert stats_to_proto(hub.stats("queue_depth", {}, window_s=0)).count == 1
