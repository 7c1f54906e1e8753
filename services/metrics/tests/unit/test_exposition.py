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


R = (("replica", "w-1"),)  # the replica label every series carries (the tests' reports come from "w-1")


def observe(exposition: Exposition, samples: list[Sample], replica: str = "w-1") -> None:
    service = dict(samples[0].labels)["service"]
    exposition.observe(observations_of(samples), service=service, replica=replica)


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
    assert latency.labels == ("replica", "model", "code")

    size = exposed("gateway", METRICS["payload_size_bytes"])
    assert (size.family, size.scale, size.buckets) == (
        "loadmaster_gateway_payload_size_bytes",
        1.0,
        SIZE_BUCKETS_BYTES,
    )
    batch = exposed("model-pool", METRICS["batch_size"])
    assert (batch.family, batch.buckets) == ("loadmaster_model_pool_batch_size", COUNT_BUCKETS)

    assert exposed("scheduler", METRICS["requests_expired"]).family == "loadmaster_scheduler_requests_expired"
    free = exposed("gpu-broker", METRICS["free_mb"])
    assert (free.family, free.scale) == ("loadmaster_gpu_broker_free_bytes", 1 << 20)  # base units
    build = exposed("gateway", METRICS["build_info"])
    assert (build.family, build.labels) == (
        "loadmaster_build_info",
        ("service", "replica", "version", "python"),
    )
    assert (
        exposed("x", MetricSpec("ops_total", MetricKind.COUNTER, "h", service="x")).family
        == "loadmaster_x_ops"
    )


def test_every_declared_series_can_be_exposed() -> None:
    exposition = Exposition(CollectorRegistry())
    for spec in METRICS.values():
        observe(exposition, [sample(spec.name, 1.0, service="svc", **dict.fromkeys(spec.labels, "v"))])
    names = {name for name, _ in scrape(exposition)}
    for spec in METRICS.values():
        family = exposed("svc", spec).family
        suffix = {MetricKind.HISTOGRAM: "_count", MetricKind.COUNTER: "_total", MetricKind.GAUGE: ""}
        assert family + suffix[spec.kind] in names


def test_histogram_converts_ms_to_seconds() -> None:
    exposition = Exposition(CollectorRegistry())
    observe(
        exposition,
        [
            sample("e2e_latency_ms", 0.8, model="m", code="ok"),
            sample("e2e_latency_ms", 3.0, model="m", code="ok"),
            sample("e2e_latency_ms", 40.0, model="m", code="expired"),
        ],
    )
    seen = scrape(exposition)
    ok = (("code", "ok"), ("model", "m"), *R)
    assert seen[("loadmaster_gateway_e2e_latency_seconds_count", ok)] == 2
    assert seen[("loadmaster_gateway_e2e_latency_seconds_sum", ok)] == pytest.approx(0.0038)
    bucket = "loadmaster_gateway_e2e_latency_seconds_bucket"
    assert seen[(bucket, (("code", "ok"), ("le", "0.001"), ("model", "m"), *R))] == 1
    assert seen[(bucket, (("code", "ok"), ("le", "0.005"), ("model", "m"), *R))] == 2


def test_bytes_stay_bytes() -> None:
    exposition = Exposition(CollectorRegistry())
    observe(exposition, [sample("payload_size_bytes", 4096.0, model="m")])
    assert scrape(exposition)[("loadmaster_gateway_payload_size_bytes_sum", (("model", "m"), *R))] == 4096.0


def test_counter_adds_increments_and_gauge_keeps_latest() -> None:
    exposition = Exposition(CollectorRegistry())
    observe(
        exposition,
        [
            sample("requests_expired", 1.0, service="scheduler", model="m"),
            sample("requests_expired", 2.0, service="scheduler", model="m"),
            sample("requests_expired", -5.0, service="scheduler", model="m"),  # ignored
            sample("queue_depth", 9.0, service="scheduler", model="m"),
            sample("queue_depth", 4.0, service="scheduler", model="m"),
        ],
    )
    seen = scrape(exposition)
    assert seen[("loadmaster_scheduler_requests_expired_total", (("model", "m"), *R))] == 3.0
    assert seen[("loadmaster_scheduler_queue_depth", (("model", "m"), *R))] == 4.0


def test_only_declared_labels_are_exposed() -> None:
    exposition = Exposition(CollectorRegistry())
    observe(
        exposition,
        [
            sample("queue_depth", 1.0, service="scheduler", model="m", request_id="r1"),
            sample("queue_depth", 2.0, service="scheduler", model="m", request_id="r2"),
            sample("queue_depth", 3.0, service="scheduler"),  # missing label -> ""
        ],
    )
    seen = scrape(exposition)
    assert seen[("loadmaster_scheduler_queue_depth", (("model", "m"), *R))] == 2.0
    assert seen[("loadmaster_scheduler_queue_depth", (("model", ""), *R))] == 3.0
    assert not any("request_id" in dict(labels) for _, labels in seen)


def test_unknown_names_are_not_exposed_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    exposition = Exposition(CollectorRegistry())
    with caplog.at_level(logging.WARNING, logger="loadmaster.metrics.exposition"):
        observe(exposition, [sample("made_up_ms", 1.0), sample("made_up_ms", 2.0, k="v")])
        observe(exposition, [sample("made_up_ms", 3.0)])
    assert not any("made_up" in name for name, _ in scrape(exposition))
    assert sum("made_up_ms" in record.getMessage() for record in caplog.records) == 1


def test_a_capped_label_exposes_values_past_its_bound_as_other() -> None:
    spec = MetricSpec(
        "tokens", MetricKind.COUNTER, "t", ("tenant",), service="model-pool", capped=(("tenant", 2),)
    )
    exposition = Exposition(CollectorRegistry(), specs={"tokens": spec})
    tenants = ["a", "b", "c", "d", "a"]
    observe(exposition, [sample("tokens", 1.0, service="model-pool", tenant=t) for t in tenants])
    seen = scrape(exposition)
    by_tenant = {
        dict(labels)["tenant"]: value for (name, labels), value in seen.items() if name.endswith("_total")
    }
    assert by_tenant == {"a": 2.0, "b": 1.0, "other": 2.0}


def test_openmetrics_when_asked() -> None:
    exposition = Exposition(CollectorRegistry())
    observe(exposition, [sample("send_errors", 1.0)])
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
        observe(exposition, [sample(name, v, **labels) for v in values[start : start + 97]])
    registry = CollectorRegistry()
    reference = Histogram(form.family, form.help, form.labels, registry=registry, buckets=form.buckets)
    for value in values:
        reference.labels("w-1", *labels.values()).observe(value * form.scale)

    def series(body: bytes) -> list[tuple[str, dict[str, str], float]]:
        return [
            (s.name, s.labels, s.value)
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples
            if not s.name.endswith("_created") and s.name.startswith(form.family)
        ]

    observed = series(exposition.render()[0])
    assert observed == series(generate_latest(registry))
    assert (form.family + "_count", {"replica": "w-1", **labels}, float(len(values))) in observed


def test_two_replicas_of_a_service_are_told_apart() -> None:
    exposition = Exposition(CollectorRegistry())
    for replica, state in (("w-1", 1.0), ("w-2", 0.0)):
        observe(
            exposition, [sample("slot_state", state, service="model-pool", model="m", state="idle")], replica
        )
    observe(exposition, [sample("worker_leased_mb", 112.0, service="model-pool", gpu="0")], "w-1")
    observe(exposition, [sample("worker_leased_mb", 368.0, service="model-pool", gpu="0")], "w-2")
    seen = scrape(exposition)
    state = "loadmaster_model_pool_slot_state"
    assert seen[(state, (("model", "m"), ("replica", "w-1"), ("state", "idle")))] == 1.0
    assert seen[(state, (("model", "m"), ("replica", "w-2"), ("state", "idle")))] == 0.0
    leased = "loadmaster_model_pool_worker_leased_bytes"
    assert seen[(leased, (("gpu", "0"), ("replica", "w-1")))] == 112 * 2**20
    assert seen[(leased, (("gpu", "0"), ("replica", "w-2")))] == 368 * 2**20


def test_counters_exist_at_zero_once_a_replica_or_model_is_seen() -> None:
    exposition = Exposition(CollectorRegistry())
    observe(exposition, [sample("active_clients", 1.0, service="scheduler")], "s-1")
    seen = scrape(exposition)
    assert seen[("loadmaster_scheduler_client_disconnected_total", (("replica", "s-1"),))] == 0.0
    assert (
        seen[("loadmaster_process_cpu_seconds_total", (("replica", "s-1"), ("service", "scheduler")))] == 0.0
    )
    assert not any(name.startswith("loadmaster_gateway_") for name, _ in seen)  # not the scheduler's

    observe(exposition, [sample("e2e_latency_ms", 2.0, model="double", code="ok")], "gw-1")
    seen = scrape(exposition)
    for code in ("ok", "expired", "internal", "unavailable"):
        assert (
            seen[
                (
                    "loadmaster_gateway_requests_total",
                    (("code", code), ("model", "double"), ("replica", "gw-1")),
                )
            ]
            == 0
        )
    assert (
        seen[
            (
                "loadmaster_gateway_observation_errors_total",
                (("code", "invalid_argument"), ("replica", "gw-1")),
            )
        ]
        == 0
    )


def test_a_silent_replica_loses_its_series() -> None:
    now = [0.0]
    exposition = Exposition(CollectorRegistry(), replica_ttl_s=60.0, clock=lambda: now[0])
    observe(exposition, [sample("queue_depth", 3.0, service="scheduler", model="m")], "s-old")
    now[0] = 50.0
    observe(exposition, [sample("queue_depth", 5.0, service="scheduler", model="m")], "s-new")
    now[0] = 100.0
    seen = scrape(exposition)
    assert ("loadmaster_scheduler_queue_depth", (("model", "m"), ("replica", "s-new"))) in seen
    assert not any(dict(labels).get("replica") == "s-old" for _, labels in seen)
    observe(exposition, [sample("queue_depth", 7.0, service="scheduler", model="m")], "s-old")  # back again
    assert (
        scrape(exposition)[("loadmaster_scheduler_queue_depth", (("model", "m"), ("replica", "s-old")))]
        == 7.0
    )
