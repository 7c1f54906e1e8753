"""OTLP over HTTP/protobuf, chosen by the standard variable, reaches a real HTTP collector."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from loadmaster.common import tracing


class _Collector(BaseHTTPRequestHandler):
    received: list[tuple[str, str, bytes]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, self.headers["Content-Type"], body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[tuple[str, list[tuple[str, str, bytes]]]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    _Collector.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", _Collector.received
    finally:
        server.shutdown()
        server.server_close()
        tracing.shutdown_tracing()


def test_http_protobuf_protocol_exports_spans_over_http(
    collector: tuple[str, list[tuple[str, str, bytes]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, received = collector
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # the exporter reads its endpoint from the environment
    assert tracing.setup_tracing("gateway", environ=env) is not None
    span = tracing.start_request_span("gateway.request", request_id="r-1", model_id="double")
    tracing.end_span(span)
    tracing.shutdown_tracing()  # flushes the batch

    assert [(path, ctype) for path, ctype, _ in received] == [("/v1/traces", "application/x-protobuf")]
    export = ExportTraceServiceRequest.FromString(received[0][2])
    spans = [s for rs in export.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert [s.name for s in spans] == ["gateway.request"]


def test_an_unknown_protocol_is_refused_by_name() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    with pytest.raises(ValueError, match="http/json"):
        tracing.setup_tracing("gateway", environ=env)
