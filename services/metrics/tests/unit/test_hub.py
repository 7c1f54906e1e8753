from __future__ import annotations

import math

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from loadmaster.common.clock import FakeClock
from loadmaster.common.errors import InvalidArgumentError
from loadmaster.metrics.dashboard import snapshot
from loadmaster.metrics.hub import MetricsHub
from loadmaster.metrics.servicer import observations_from_batch, sample_to_proto, stats_to_proto
from loadmaster.metrics.windows import Sample, label_set, observations_of
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

    assert hub.ingest(observations_of(samples), service="gateway") == 2

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
    batch = metrics_pb2.ReportRequest(service="scheduler", instance="s-1")
    batch.samples.add(
        name="queue_depth", value=5, labels={"model": "m", "service": "spoofed"}, timestamp_unix_ns=7
    )
    with hub.watch(names=["queue_depth"], labels={"service": "scheduler"}) as watch:
        assert hub.ingest(observations_from_batch(batch), service=batch.service, instance=batch.instance) == 1
        watched = await anext(aiter(watch))

    [latest] = hub.latest("", {"model": "m"})
    assert sample_to_proto(latest) == metrics_pb2.Sample(
        name="queue_depth", value=5, labels={"model": "m", "service": "scheduler"}, timestamp_unix_ns=7
    )
    assert watched == [latest]
    assert own(hub, "loadmaster_scheduler_queue_depth", model="m", replica="s-1") == 5
    assert stats_to_proto(hub.stats("queue_depth", {}, window_s=0)).count == 1


def series_batch(
    service: str, samples: list[tuple[str, float, dict[str, str], int]]
) -> metrics_pb2.ReportRequest:
    """`samples` as a reporter sends them now: each series once, values packed, timestamp deltas."""
    batch = metrics_pb2.ReportRequest(service=service)
    by_series: dict[tuple[str, tuple[tuple[str, str], ...]], list[tuple[float, int]]] = {}
    for name, value, labels, timestamp in samples:
        by_series.setdefault((name, tuple(labels.items())), []).append((value, timestamp))
    for (name, labels), observed in by_series.items():
        timestamps = [timestamp for _, timestamp in observed]
        batch.series.add(
            name=name,
            labels=dict(labels),
            values=[value for value, _ in observed],
            timestamp_deltas_ns=np.diff(timestamps, prepend=0).tolist(),
        )
    return batch


def traffic(seed: int) -> list[tuple[str, float, dict[str, str], int]]:
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(400):
        model = f"m{i % 3}"
        code = "ok" if i % 11 else "expired"
        timestamp = 1_700_000_000_000_000_000 + i * 1_000_003
        samples += [
            ("e2e_latency_ms", float(rng.lognormal(1.0, 0.8)), {"model": model, "code": code}, timestamp),
            ("requests", 1.0, {"model": model, "code": code}, timestamp),
            ("scheduling_wait_ms", float(rng.exponential(0.3)), {"model": model}, timestamp),
            ("inference_latency_ms", float(rng.lognormal(-1.0, 0.5)), {"model": model}, timestamp),
            ("batch_size", float(1 + i % 4), {"model": model}, timestamp),
            ("queue_depth", float(i % 5), {"model": model}, timestamp),
            ("payload_size_bytes", float(rng.integers(100, 1 << 22)), {"model": model}, timestamp),
        ]
    return samples


def answers(hub: MetricsHub) -> dict[str, object]:
    """Every query's answer, and the exposition of the reported series without creation times."""
    names = [
        "e2e_latency_ms",
        "requests",
        "scheduling_wait_ms",
        "inference_latency_ms",
        "batch_size",
        "queue_depth",
    ]
    body, _ = hub.exposition.render()
    return {
        "stats": [
            hub.stats(name, labels, window_s=window_s)
            for name in names
            for labels in ({}, {"model": "m1"}, {"model": "m2", "code": "ok"})
            for window_s in (0.0, 5.0, 30.0)
        ],
        "latest": hub.latest("", {}),
        "models": [hub.model_statistics("", window_s=window_s) for window_s in (0.0, 5.0)],
        "dashboard": snapshot(hub.windows, window_s=60.0, step_s=1.0),
        "exposition": [
            line
            for line in body.decode().splitlines()
            if "_created" not in line and "loadmaster_metrics_" not in line
        ],
    }


def test_series_batches_answer_every_query_as_one_sample_per_batch_did() -> None:
    """The packed form (one batch per flush) and the old form (here the extreme: one sample per
    batch, as sequential as the old ingest) leave the same state behind, to the last bit."""
    packed, one_by_one = make_hub(), make_hub()
    clocks = [packed._clock, one_by_one._clock]
    for flush in range(4):
        samples = traffic(flush)
        assert packed.ingest(
            observations_from_batch(series_batch("gateway", samples)), service="gateway"
        ) == len(samples)
        for name, value, labels, timestamp in samples:
            old = metrics_pb2.ReportRequest(service="gateway")
            old.samples.add(name=name, value=value, labels=labels, timestamp_unix_ns=timestamp)
            assert one_by_one.ingest(observations_from_batch(old), service="gateway") == 1
        for clock in clocks:
            assert isinstance(clock, FakeClock)
            clock.advance(10.0)

    assert answers(packed) == answers(one_by_one)
    assert answers(packed)["stats"][0].count == 1600  # the comparison is not of empty answers


def test_invalid_series_are_refused_whole_and_non_finite_values_one_by_one() -> None:
    hub = make_hub()
    batch = metrics_pb2.ReportRequest(service="model-pool")
    batch.series.add(
        name="batch_size", values=[1.0, math.nan, 2.0, math.inf], timestamp_deltas_ns=[5, 1, 1, 1]
    )
    batch.series.add(name="", values=[1.0, 2.0], timestamp_deltas_ns=[5, 1])  # no name
    batch.series.add(
        name="batch_size", labels={"k": "v"}, values=[1.0, 2.0], timestamp_deltas_ns=[5]
    )  # 1 of 2
    batch.series.add(name="queue_depth", values=[3.0, 4.0])  # no timestamps: received now

    assert hub.ingest(observations_from_batch(batch), service="model-pool") == 4

    assert own(hub, "loadmaster_metrics_samples_refused_total", reason="invalid") == 6
    assert hub.stats("batch_size", {}, window_s=0).sum == 3.0
    [depth] = hub.latest("queue_depth", {})
    assert (depth.value, depth.timestamp_unix_ns) == (4.0, int(hub._clock.time() * 1e9))
    [size] = hub.latest("batch_size", {})
    assert size.timestamp_unix_ns == 7  # the deltas of the values kept: 5 + 1 + 1
