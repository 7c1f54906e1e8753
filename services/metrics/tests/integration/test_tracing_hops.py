"""One request's trace across a real gRPC hop (GrpcServer + aio_channel, instrumented) and a real
ZMQ hop (context in the InferRequest metadata), in one in-memory exporter."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq
import zmq.asyncio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from loadmaster.common import tracing
from loadmaster.common.config import MetricsSettings, Settings
from loadmaster.common.framing import router_reply, split_router_frames
from loadmaster.common.grpc_client import aio_channel
from loadmaster.metrics.server import build
from loadmaster.v1 import metrics_pb2, metrics_pb2_grpc, model_pool_pb2


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.setup_tracing("test", exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown_tracing()


async def test_one_trace_over_grpc_and_zmq(exporter: InMemorySpanExporter) -> None:
    server = await build(
        Settings(metrics=MetricsSettings(address="127.0.0.1:0", http_host="127.0.0.1", http_port=0))
    )
    await server.start()
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    tracer = tracing.get_tracer("test")
    try:
        with tracer.start_as_current_span(
            "gateway.request", attributes=tracing.request_attributes("req-1", "double")
        ) as root:
            async with aio_channel(f"127.0.0.1:{server.port}") as channel:
                await metrics_pb2_grpc.MetricsServiceStub(channel).GetStats(
                    metrics_pb2.GetStatsRequest(name="x"), timeout=5
                )
            with tracer.start_as_current_span("gateway.dispatch"):
                request = model_pool_pb2.InferRequest(request_id="req-1", model_id="double")
                tracing.inject(request.metadata)
                await dealer.send_multipart([b"", request.SerializeToString(), b"payload"])
                # the worker side: parent its span on the envelope's context
                split = split_router_frames(await router.recv_multipart())
                received = model_pool_pb2.InferRequest.FromString(split.envelope)
                with tracer.start_as_current_span(
                    "model_pool.infer",
                    context=tracing.extract(received.metadata),
                    kind=SpanKind.SERVER,
                    attributes=tracing.request_attributes(received.request_id, received.model_id),
                ):
                    await router.send_multipart(router_reply(split.identity, b"reply"))
                assert (await dealer.recv_multipart())[1] == b"reply"
    finally:
        dealer.close(0)
        router.close(0)
        ctx.term()
        await server.stop()

    spans = {span.name: span for span in exporter.get_finished_spans()}
    trace_id = root.get_span_context().trace_id
    grpc_spans = [s for s in exporter.get_finished_spans() if s.name.endswith("MetricsService/GetStats")]
    assert {s.kind for s in grpc_spans} == {SpanKind.CLIENT, SpanKind.SERVER}, sorted(spans)
    client = next(s for s in grpc_spans if s.kind is SpanKind.CLIENT)
    server_span = next(s for s in grpc_spans if s.kind is SpanKind.SERVER)
    assert client.parent.span_id == root.get_span_context().span_id
    assert server_span.parent.span_id == client.context.span_id
    worker = spans["model_pool.infer"]
    assert worker.parent.span_id == spans["gateway.dispatch"].context.span_id
    assert spans["gateway.dispatch"].parent.span_id == root.get_span_context().span_id
    assert worker.attributes[tracing.REQUEST_ID] == "req-1"
    assert {s.context.trace_id for s in exporter.get_finished_spans()} == {trace_id}
    # health checks and the metrics Report stream stay out of traces
    assert not [s for s in exporter.get_finished_spans() if "Health" in s.name or "Report" in s.name]
