from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from loadmaster.common import tracing


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.setup_tracing("test", exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown_tracing()


def test_off_without_endpoint_and_costs_nothing() -> None:
    assert tracing.setup_tracing("svc", environ={}) is None
    assert not tracing.enabled()
    assert tracing.server_interceptors() == [] and tracing.client_interceptors() == []
    metadata: dict[str, str] = {}
    with tracing.get_tracer().start_as_current_span("x") as span:
        assert not span.is_recording()
        tracing.inject(metadata)
    assert metadata == {}
    assert tracing.extract({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) == {}


def test_otlp_exporter_when_the_endpoint_is_set() -> None:
    provider = tracing.setup_tracing(
        "svc", environ={tracing.OTLP_ENDPOINT_ENV: "http://127.0.0.1:4317"}, batch=False
    )
    try:
        assert provider is not None and tracing.enabled()
        assert provider.resource.attributes["service.name"] == "svc"
        assert len(tracing.server_interceptors()) == 1
        assert len(tracing.client_interceptors()) == 4
    finally:
        tracing.shutdown_tracing()
    assert not tracing.enabled()


def test_inject_extract_carries_the_context_through_string_metadata(exporter: InMemorySpanExporter) -> None:
    tracer = tracing.get_tracer()
    metadata = {"timeout_ms": "50"}
    with tracer.start_as_current_span("gateway.dispatch") as parent:
        tracing.inject(metadata)
    assert set(metadata) == {"timeout_ms", "traceparent"}
    assert all(isinstance(v, str) for v in metadata.values())

    with tracer.start_as_current_span(
        "model_pool.infer",
        context=tracing.extract(metadata),
        attributes=tracing.request_attributes("r1", "m"),
    ):
        pass
    child, parent_span = sorted(exporter.get_finished_spans(), key=lambda s: s.name, reverse=True)
    assert child.name == "model_pool.infer"
    assert child.parent is not None and child.parent.span_id == parent.get_span_context().span_id
    assert child.context.trace_id == parent_span.context.trace_id
    assert child.attributes[tracing.REQUEST_ID] == "r1" and child.attributes[tracing.MODEL_ID] == "m"


def test_inject_an_explicit_span_and_extract_nothing(exporter: InMemorySpanExporter) -> None:
    span = tracing.get_tracer().start_span("root")
    metadata: dict[str, str] = {}
    tracing.inject(metadata, span=span)
    span.end()
    assert metadata["traceparent"].split("-")[1] == format(span.get_span_context().trace_id, "032x")
    assert trace.get_current_span(tracing.extract({})) is trace.INVALID_SPAN


@pytest.mark.parametrize(
    ("method", "traced"),
    [
        ("/loadmaster.v1.SchedulerService/ListWorkers", True),
        (b"/loadmaster.v1.MetricsService/GetStats", True),
        ("/loadmaster.v1.MetricsService/Report", False),
        ("/grpc.health.v1.Health/Watch", False),
        (b"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", False),
    ],
)
def test_health_reflection_and_report_are_not_traced(method: str | bytes, traced: bool) -> None:
    assert tracing._filter(SimpleNamespace(method=method)) is traced


def test_request_spans_parent_on_the_carrier_and_record_failures(exporter: InMemorySpanExporter) -> None:
    root = tracing.start_request_span("gateway.request", request_id="r1", model_id="double")
    metadata: dict[str, str] = {}
    tracing.inject(metadata, span=root)
    worker = tracing.start_request_span(
        "model_pool.infer", request_id="r1", model_id="double", carrier=metadata, kind=trace.SpanKind.SERVER
    )
    tracing.end_span(worker, error_code="internal")
    tracing.end_span(root)

    by_name = {span.name: span for span in exporter.get_finished_spans()}
    assert by_name["model_pool.infer"].parent.span_id == root.get_span_context().span_id
    assert by_name["model_pool.infer"].status.status_code is trace.StatusCode.ERROR
    assert by_name["model_pool.infer"].attributes[tracing.ERROR_CODE] == "internal"
    assert by_name["gateway.request"].status.status_code is trace.StatusCode.UNSET
    assert by_name["gateway.request"].attributes[tracing.REQUEST_ID] == "r1"


def test_request_spans_cost_nothing_while_off() -> None:
    span = tracing.start_request_span("gateway.request", request_id="r1")
    assert span is trace.INVALID_SPAN
    tracing.end_span(span, error_code="internal")  # no error
