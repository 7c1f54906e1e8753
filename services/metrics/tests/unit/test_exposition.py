from __future__ import annotations

import logging

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loadmaster.common.metric_names import METRICS, MetricKind, MetricSpec
from loadmaster.metrics.exposition import (
    COUNT_BUCKETS,
    LATENCY_BUCKETS_S,
    SIZE_BUCKETS_BYTES,
    Exposition,
    exposed,
)
from loadmaster.metrics.windows import Sample, label_set, observations_of


def sample(name: str, value: float, service: str = "gateway", **labels: str) -> Sample:
    return Sample(name, value, label_set(labels, service=service))


def scrape(exposition: Exposition) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, content_type = exposition.render()
    assert content_type.startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def test_names_units_and_kinds() -> None:
    latency = exposed("gateway", METRICS["e2e_latency_ms"])
    assert (latency.family, latency.kind, latency.scale) == (
        "loadmaster_gateway_e2e_latency_seconds",
        MetricKind.HISTOGRAM,
        0.001,
    )
    assert latency.buckets == LATENCY_BUCKETS_S
    assert latency.labels == ("model", "code")

    size = exposed("gateway", METRICS["payload_size_bytes"])
    assert (size.family, size.scale, size.buckets) == (
        "loadmaster_gateway_payload_size_bytes",
        1.0,
        SIZE_BUCKETS_BYTES,
    )
    batch = exposed("model-pool", METRICS["batch_size"])
    assert (batch.family, batch.buckets) == ("loadmaster_model_pool_batch_size", COUNT_BUCKETS)

    assert exposed("scheduler", METRICS["requests_expired"]).family == "loadmaster_scheduler_requests_expired"
    assert exposed("gpu-broker", METRICS["free_mb"]).family == "loadmaster_gpu_broker_free_mb"
    assert exposed("x", MetricSpec("ops_total", MetricKind.COUNTER, "h")).family == "loadmaster_x_ops"


def test_every_declared_series_can_be_exposed() -> None:
    exposition = Exposition(CollectorRegistry())
    for spec in METRICS.values():
        exposition.observe(
            observations_of([sample(spec.name, 1.0, service="svc", **dict.fromkeys(spec.labels, "v"))])
        )
    names = {name for name, _ in scrape(exposition)}
    for spec in METRICS.values():
        family = exposed("svc", spec).family
        suffix = {MetricKind.HISTOGRAM: "_count", MetricKind.COUNTER: "_total", MetricKind.GAUGE: ""}
        assert family + suffix[spec.kind] in names


def test_histogram_converts_ms_to_seconds() -> None:
    exposition = Exposition(CollectorRegistry())
    exposition.observe(
        observations_of(
            [
                sample("e2e_latency_ms", 0.8, model="m", code="ok"),
                sample("e2e_latency_ms", 3.0, model="m", code="ok"),
                sample("e2e_latency_ms", 40.0, model="m", code="expired"),
            ]
        )
    )
    seen = scrape(exposition)
    ok = (("code", "ok"), ("model", "m"))
    assert seen[("loadmaster_gateway_e2e_latency_seconds_count", ok)] == 2
    assert seen[("loadmaster_gateway_e2e_latency_seconds_sum", ok)] == pytest.approx(0.0038)
    bucket = "loadmaster_gateway_e2e_latency_seconds_bucket"
    assert seen[(bucket, (("code", "ok"), ("le", "0.001"), ("model", "m")))] == 1
    assert seen[(bucket, (("code", "ok"), ("le", "0.005"), ("model", "m")))] == 2


def test_bytes_stay_bytes() -> None:
    exposition = Exposition(CollectorRegistry())
    exposition.observe(observations_of([sample("payload_size_bytes", 4096.0, model="m")]))
    assert scrape(exposition)[("loadmaster_gateway_payload_size_bytes_sum", (("model", "m"),))] == 4096.0


def test_counter_adds_increments_and_gauge_keeps_latest() -> None:
    exposition = Exposition(CollectorRegistry())
    exposition.observe(
        observations_of(
            [
                sample("requests_expired", 1.0, service="scheduler", model="m"),
                sample("requests_expired", 2.0, service="scheduler", model="m"),
                sample("requests_expired", -5.0, service="scheduler", model="m"),  # ignored
                sample("queue_depth", 9.0, service="scheduler", model="m"),
                sample("queue_depth", 4.0, service="scheduler", model="m"),
            ]
        )
    )
    seen = scrape(exposition)
    assert seen[("loadmaster_scheduler_requests_expired_total", (("model", "m"),))] == 3.0
    assert seen[("loadmaster_scheduler_queue_depth", (("model", "m"),))] == 4.0


def test_only_declared_labels_are_exposed() -> None:
    exposition = Exposition(CollectorRegistry())
    exposition.observe(
        observations_of(
            [
                sample("queue_depth", 1.0, service="scheduler", model="m", request_id="r1"),
                sample("queue_depth", 2.0, service="scheduler", model="m", request_id="r2"),
                sample("queue_depth", 3.0, service="scheduler"),  # missing label -> ""
            ]
        )
    )
    seen = scrape(exposition)
    assert seen[("loadmaster_scheduler_queue_depth", (("model", "m"),))] == 2.0
    assert seen[("loadmaster_scheduler_queue_depth", (("model", ""),))] == 3.0
    assert not any("request_id" in dict(labels) for _, labels in seen)


def test_unknown_names_are_not_exposed_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    exposition = Exposition(CollectorRegistry())
    with caplog.at_level(logging.WARNING, logger="loadmaster.metrics.exposition"):
        exposition.observe(observations_of([sample("made_up_ms", 1.0), sample("made_up_ms", 2.0, k="v")]))
        exposition.observe(observations_of([sample("made_up_ms", 3.0)]))
    assert not any("made_up" in name for name, _ in scrape(exposition))
    assert sum("made_up_ms" in record.getMessage() for record in caplog.records) == 1


def test_openmetrics_when_asked() -> None:
    exposition = Exposition(CollectorRegistry())
    exposition.observe(observations_of([sample("send_errors", 1.0)]))
    body, content_type = exposition.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")


@pytest.mark.parametrize("name", ["e2e_latency_ms", "payload_size_bytes", "batch_size"])
def test_a_series_observed_at_once_renders_as_one_observe_per_value(name: str) -> None:
    """The batched histogram update (which reaches into prometheus_client's histogram) against
    the library's own `observe`, on values at, between and beyond the bucket bounds."""
    rng = np.random.default_rng(5)
    spec = METRICS[name]
    form = exposed("gateway", spec)
    bounds = [bound / form.scale for bound in form.buckets]
    values = [*bounds, *(b * 1.000001 for b in bounds), *rng.lognormal(2.0, 3.0, 500).tolist(), 0.0, 1e12]
    labels = dict.fromkeys(spec.labels, "v")

    exposition = Exposition(CollectorRegistry())
    for start in range(0, len(values), 97):
        exposition.observe(observations_of([sample(name, v, **labels) for v in values[start : start + 97]]))
    registry = CollectorRegistry()
    reference = Histogram(form.family, form.help, form.labels, registry=registry, buckets=form.buckets)
    for value in values:
        reference.labels(*labels.values()).observe(value * form.scale)

    def series(body: bytes) -> list[tuple[str, dict[str, str], float]]:
        return [
            (s.name, s.labels, s.value)
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples
            if not s.name.endswith("_created")
        ]

    observed = series(exposition.render()[0])
    assert observed == series(generate_latest(registry))
    assert (form.family + "_count", labels, float(len(values))) in observed
