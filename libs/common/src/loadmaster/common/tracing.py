"""OpenTelemetry tracing for every service: one trace per request, gateway -> scheduler -> worker.

- `setup_tracing(service)` is called once per process by `service.run_service`: it installs an
  SDK tracer provider exporting over OTLP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set (the
  standard OpenTelemetry variable): over gRPC, or HTTP/protobuf when
  `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL` says `http/protobuf`; the
  exporter honours the other `OTEL_EXPORTER_OTLP_*` variables itself). Without it tracing stays off and costs nothing: no interceptors are installed and
  `start_span` returns non-recording spans. Tests pass their own exporter
  (`InMemorySpanExporter`) instead.
- gRPC hops: `GrpcServer` and `aio_channel` add `server_interceptors()` /
  `client_interceptors()` (opentelemetry-instrumentation-grpc), which are empty while tracing is
  off. Health checks, reflection and the long-lived metrics `Report` stream are not traced.
- HTTP front ends honour an incoming W3C `traceparent` header the same way: the handler runs
  inside `incoming_context(request.headers)`, so the request's span is the caller's child.
- The ZMQ data plane carries the context in the envelope's string metadata map (W3C
  `traceparent` / `tracestate` keys): the sender calls `inject(metadata)` inside its span, the
  receiver parents its span on `extract(metadata)`.

Span attributes use `loadmaster.request_id` and `loadmaster.model_id` (`request_attributes`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

__all__ = [
    "ERROR_CODE",
    "MODEL_ID",
    "OTLP_ENDPOINT_ENV",
    "REQUEST_ID",
    "TRACE_KEYS",
    "client_interceptors",
    "enabled",
    "end_span",
    "extract",
    "get_tracer",
    "incoming_context",
    "inject",
    "otlp_exporter",
    "request_attributes",
    "server_interceptors",
    "setup_tracing",
    "shutdown_tracing",
    "start_request_span",
]

log = logging.getLogger(__name__)

OTLP_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
# The standard variables that choose the OTLP transport (the first one set wins).
OTLP_PROTOCOL_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
REQUEST_ID = "loadmaster.request_id"
MODEL_ID = "loadmaster.model_id"
ERROR_CODE = "loadmaster.error_code"
# The metadata keys `inject` may write (W3C trace context); receivers may strip them.
TRACE_KEYS = ("traceparent", "tracestate")
_UNTRACED_SERVICES = (
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
)
_UNTRACED_METHODS = ("/loadmaster.v1.MetricsService/Report",)

_provider: TracerProvider | None = None


def setup_tracing(
    service: str,
    *,
    exporter: SpanExporter | None = None,
    environ: Mapping[str, str] | None = None,
    batch: bool | None = None,
) -> TracerProvider | None:
    """Turn tracing on for this process, exporting to `exporter`, else over OTLP when
    `OTEL_EXPORTER_OTLP_ENDPOINT` is set in `environ` (default: the process environment).
    Returns the provider, or None when tracing stays off. Spans are batched off the hot path
    (`batch`, default: True for OTLP, False for a given exporter so tests see spans at once).

    The provider is this module's, not OpenTelemetry's global one (which can be set only once
    per process), so tests can turn tracing on and off: take tracers from `get_tracer()` when
    building a component, not at import time."""
    global _provider
    env = os.environ if environ is None else environ
    if exporter is None:
        endpoint = env.get(OTLP_ENDPOINT_ENV, "").strip()
        if not endpoint:
            return None
        protocol = next((env[name].strip() for name in OTLP_PROTOCOL_ENVS if env.get(name)), "grpc")
        exporter = otlp_exporter(protocol)
        batch = True if batch is None else batch
        log.info("tracing: exporting spans over OTLP (%s) to %s", protocol, endpoint)
    shutdown_tracing()
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
    _provider = provider
    return provider


def otlp_exporter(protocol: str) -> SpanExporter:
    """The OTLP span exporter for a standard protocol value; each reads the
    `OTEL_EXPORTER_OTLP_*` variables (endpoint, headers, timeout, ...) itself."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter()
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported: use grpc or http/protobuf")


def shutdown_tracing() -> None:
    """Flush what is pending and turn tracing off (service exit, test teardown)."""
    global _provider
    provider, _provider = _provider, None
    if provider is not None:
        provider.force_flush(timeout_millis=2000)
        provider.shutdown()


def enabled() -> bool:
    return _provider is not None


def get_tracer(name: str = "loadmaster") -> trace.Tracer:
    """A tracer of the current provider (a no-op tracer while tracing is off)."""
    if _provider is None:
        return trace.NoOpTracer()
    return _provider.get_tracer(name)


def request_attributes(request_id: str, model_id: str = "") -> dict[str, str]:
    attributes = {REQUEST_ID: request_id}
    if model_id:
        attributes[MODEL_ID] = model_id
    return attributes


def start_request_span(
    name: str,
    *,
    request_id: str,
    model_id: str = "",
    carrier: Mapping[str, str] | None = None,
    kind: trace.SpanKind = trace.SpanKind.INTERNAL,
) -> trace.Span:
    """Start (not activate) the span of one request's stay in this service, parented on the
    context in `carrier` (an envelope's metadata) when given, else on the current context.
    End it with `end_span`. A non-recording span while tracing is off (about a microsecond)."""
    if _provider is None:
        return trace.INVALID_SPAN
    context = extract(carrier) if carrier is not None else None
    return _provider.get_tracer("loadmaster").start_span(
        name, context=context, kind=kind, attributes=request_attributes(request_id, model_id)
    )


def end_span(span: trace.Span, *, error_code: str = "") -> None:
    """End a request span; a non-empty edge `error_code` (`expired`, `internal`, ...) marks it
    failed and is kept as the `loadmaster.error_code` attribute."""
    if not span.is_recording():
        return
    if error_code:
        span.set_attribute(ERROR_CODE, error_code)
        span.set_status(trace.Status(trace.StatusCode.ERROR, error_code))
    span.end()


def inject(metadata: MutableMapping[str, str], *, span: trace.Span | None = None) -> None:
    """Write the current trace context (or `span`'s) into `metadata`; nothing when tracing is off
    or there is no sampled span."""
    if _provider is None:
        return
    ctx = trace.set_span_in_context(span) if span is not None else None
    propagate.inject(metadata, context=ctx)


def extract(metadata: Mapping[str, str]) -> otel_context.Context:
    """The trace context `inject` wrote into `metadata` (an empty context when there is none),
    to pass as `context=` when starting the receiving span."""
    if _provider is None or "traceparent" not in metadata:
        return otel_context.Context()
    return propagate.extract(metadata)


@contextlib.contextmanager
def incoming_context(headers: Mapping[str, str]) -> Iterator[None]:
    """Make the trace context in `headers` (an HTTP request's `traceparent` / `tracestate`)
    current inside the block, so spans started there (and in tasks created there) are the
    caller's children. Nothing when tracing is off or the request carries no `traceparent`."""
    if _provider is None or "traceparent" not in headers:
        yield
        return
    token = otel_context.attach(propagate.extract(headers))
    try:
        yield
    finally:
        otel_context.detach(token)


def _traced(method: str) -> bool:
    if method in _UNTRACED_METHODS:
        return False
    service = method.lstrip("/").split("/", 1)[0]
    return service not in _UNTRACED_SERVICES


def _filter(details: Any) -> bool:
    method = getattr(details, "method", "") or ""
    if isinstance(method, bytes):  # grpc.aio passes bytes on some paths
        method = method.decode()
    return _traced(method)


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """The OpenTelemetry server interceptor when tracing is on, else none."""
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=_provider, filter_=_filter)]


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """The OpenTelemetry client interceptors when tracing is on, else none."""
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors(tracer_provider=_provider, filter_=_filter))
