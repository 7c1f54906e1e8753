"""Traces from the real service processes, exported over OTLP/gRPC (OTEL_EXPORTER_OTLP_ENDPOINT)
to a collector this test runs: gRPC hops between processes join one trace."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.http as triton_http
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from loadmaster.cli.launcher import Suite, free_port_overrides
from loadmaster.client import Connection

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class ExportedSpan:
    service: str
    name: str
    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes
    kind: int
    attributes: dict[str, str]


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver keeping every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[ExportedSpan] = []
        self._lock = threading.Lock()
        self.arrived = threading.Condition(self._lock)

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext):  # noqa: N802
        with self.arrived:
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        self.spans.append(
                            ExportedSpan(
                                resource.get("service.name", ""),
                                span.name,
                                span.trace_id,
                                span.span_id,
                                span.parent_span_id,
                                span.kind,
                                {a.key: a.value.string_value for a in span.attributes},
                            )
                        )
            self.arrived.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, predicate, timeout_s: float) -> list[ExportedSpan]:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        with self.arrived:
            while not predicate(self.spans):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.arrived.wait(remaining)
            return list(self.spans)


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, int]]:
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield collector, port
    finally:
        server.stop(0)


@pytest.fixture(scope="module")
def traced_suite(
    collector: tuple[Collector, int], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Suite]:
    _, port = collector
    overrides = free_port_overrides()
    overrides["model_pool"]["preload"] = ["double"]
    with pytest.MonkeyPatch.context() as env:  # the children inherit the environment
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        env.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s
        suite = Suite(
            ROOT / "examples" / "loadmaster.yaml",
            overrides=overrides,
            log_dir=tmp_path_factory.mktemp("traced"),
        )
        suite.start(timeout_s=120)
    try:
        suite.wait_for_models(["double"], timeout_s=120)
        yield suite
    finally:
        suite.stop()


def test_grpc_hops_between_processes_join_one_trace(
    traced_suite: Suite, collector: tuple[Collector, int]
) -> None:
    spans_of, _ = collector
    with Connection(traced_suite.settings.gateway.edge.bind) as conn:
        assert conn.model("double").infer(x=np.ones(3, np.float32))["x"].tolist() == [2, 2, 2]

    def acquire_hop(spans: list[ExportedSpan]) -> tuple[ExportedSpan, ExportedSpan] | None:
        """The broker's server span of an Acquire and the model-pool's client span it came from."""
        by_id = {s.span_id: s for s in spans}
        for server in spans:
            if server.service == "gpu-broker" and server.name.endswith("GpuBrokerService/Acquire"):
                client = by_id.get(server.parent_span_id)
                if client is not None:
                    return client, server
        return None

    spans = spans_of.wait_for(lambda found: acquire_hop(found) is not None, timeout_s=20)
    hop = acquire_hop(spans)
    assert hop is not None, sorted({(s.service, s.name) for s in spans})
    # The model-pool's lease Acquire: its client span (model-pool) is the parent of the broker's
    # server span (gpu-broker), in one trace.
    client, server = hop
    assert client.service == "model-pool" and client.name == server.name
    assert client.trace_id == server.trace_id
    assert (client.kind, server.kind) == (3, 2)  # SPAN_KIND_CLIENT, SPAN_KIND_SERVER
    # Health checks and the metrics Report streams are not traced.
    assert not [s for s in spans if "Health" in s.name or "MetricsService/Report" in s.name]


def test_one_request_is_one_trace_from_gateway_through_scheduler_to_worker(
    traced_suite: Suite, collector: tuple[Collector, int]
) -> None:
    spans_of, _ = collector
    with Connection(traced_suite.settings.gateway.edge.bind) as conn:
        assert conn.model("double").infer(x=np.ones(2, np.float32))["x"].tolist() == [2, 2]

    def request_spans(spans: list[ExportedSpan]) -> dict[str, ExportedSpan] | None:
        """The gateway's request span and the scheduler's and worker's spans of the same request."""
        names = {
            "gateway.request": "gateway",
            "scheduler.queue": "scheduler",
            "model_pool.infer": "model-pool",
        }
        by_request: dict[str, dict[str, ExportedSpan]] = {}
        for span in spans:
            if names.get(span.name) == span.service:
                by_request.setdefault(span.attributes.get("loadmaster.request_id", ""), {})[span.name] = span
        complete = [found for found in by_request.values() if len(found) == 3]
        return complete[-1] if complete else None

    spans = spans_of.wait_for(lambda found: request_spans(found) is not None, timeout_s=20)
    tree = request_spans(spans)
    assert tree is not None, sorted({(s.service, s.name) for s in spans})
    gateway, queued, worker = tree["gateway.request"], tree["scheduler.queue"], tree["model_pool.infer"]
    assert gateway.trace_id == queued.trace_id == worker.trace_id
    assert queued.parent_span_id == gateway.span_id  # context carried in RequestInfo.trace_context
    assert worker.parent_span_id == gateway.span_id  # context carried in the ZMQ envelope's metadata
    assert gateway.attributes["loadmaster.model_id"] == "double"
    assert "loadmaster.error_code" not in gateway.attributes


def test_an_http_request_joins_the_callers_trace_through_its_traceparent(
    traced_suite: Suite, collector: tuple[Collector, int]
) -> None:
    """KServe v2 over HTTP with the stock client and a W3C `traceparent` header: the gateway's
    request span is a child of the caller's span, in the caller's trace."""
    spans_of, _ = collector
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    gateway = traced_suite.settings.gateway
    client = triton_http.InferenceServerClient(f"{gateway.http_host}:{gateway.http_port}")
    tensor = triton_http.InferInput("x", [2], "FP32")
    tensor.set_data_from_numpy(np.ones(2, np.float32))
    result = client.infer("double", [tensor], headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
    assert result.as_numpy("x").tolist() == [2, 2]

    def joined(spans: list[ExportedSpan]) -> ExportedSpan | None:
        return next(
            (s for s in spans if s.name == "gateway.request" and s.trace_id == bytes.fromhex(trace_id)), None
        )

    span = joined(spans_of.wait_for(lambda found: joined(found) is not None, timeout_s=20))
    assert span is not None and span.service == "gateway"
    assert span.parent_span_id == bytes.fromhex(parent_id)
    assert span.attributes["loadmaster.model_id"] == "double"
