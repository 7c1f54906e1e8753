"""The metrics service in-process: the client's `on_metric`, `GetModelStatistics` and the dashboard
JSON, fed through the real `TelemetryReporter`."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest

from loadmaster.client import MetricSample, on_metric
from loadmaster.common.config import MetricsSettings, SchedulerSettings, Settings
from loadmaster.common.grpc_client import aio_channel
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.metrics.server import MetricsServer, build
from loadmaster.v1 import metrics_pb2, metrics_pb2_grpc


@pytest.fixture
def metrics_settings() -> Settings:
    """For the conftest's `server`: no scheduler there, so states come from samples."""
    return Settings(
        metrics=MetricsSettings(address="127.0.0.1:0", http_host="127.0.0.1", http_port=0),
        scheduler=SchedulerSettings(address="127.0.0.1:1"),
    )


async def report(
    server: MetricsServer, service: str, samples: list[tuple[str, float, dict[str, str]]]
) -> None:
    reporter = TelemetryReporter(
        service, f"{service}-1", f"127.0.0.1:{server.port}", flush_interval_s=0.01, process_interval_s=None
    )
    reporter.start()
    for name, value, labels in samples:
        reporter.record(name, value, labels)
    await reporter.close(timeout_s=10.0)
    assert reporter.sent == len(samples)


async def test_on_metric_delivers_matching_samples_until_closed(server: MetricsServer) -> None:
    got: list[MetricSample] = []
    arrived = threading.Event()

    def callback(sample: MetricSample) -> None:
        got.append(sample)
        if len(got) == 2:
            arrived.set()
        if sample.value == 13:
            raise RuntimeError("a failing callback does not end the subscription")

    subscription = on_metric(
        callback, address=f"127.0.0.1:{server.port}", names=["e2e_latency_ms"], labels={"model": "double"}
    )
    try:
        assert await asyncio.to_thread(subscription.wait_ready, 10)
        await report(
            server,
            "gateway",
            [
                ("e2e_latency_ms", 13, {"model": "double", "code": "ok"}),
                ("e2e_latency_ms", 99, {"model": "other", "code": "ok"}),
                ("requests", 1, {"model": "double", "code": "ok"}),
                ("e2e_latency_ms", 2.5, {"model": "double", "code": "ok"}),
            ],
        )
        assert await asyncio.to_thread(arrived.wait, 10)
    finally:
        await asyncio.to_thread(subscription.close)
    assert [(s.name, s.value) for s in got] == [("e2e_latency_ms", 13), ("e2e_latency_ms", 2.5)]
    assert got[0].labels == {"model": "double", "code": "ok", "service": "gateway"}
    assert got[0].timestamp_unix_ns > 0
    assert subscription.callback_errors == 1 and subscription.received == 2


async def test_on_metric_reconnects_when_the_service_comes_back() -> None:
    settings = Settings(metrics=MetricsSettings(address="127.0.0.1:0", http_host="127.0.0.1", http_port=0))
    first = await build(settings)
    await first.start()
    port = first.port
    got: list[float] = []
    subscription = on_metric(lambda s: got.append(s.value), address=f"127.0.0.1:{port}")
    try:
        assert await asyncio.to_thread(subscription.wait_ready, 10)
        await first.stop()
        settings = Settings(metrics=MetricsSettings(address=f"127.0.0.1:{port}", http_port=0))
        second = await build(settings)
        await second.start()
        try:
            # Right after the stop the subscription may not have noticed the drop yet (wait_ready
            # can still say True), so keep reporting until a sample from the new server arrives.
            for _ in range(100):
                await report(second, "scheduler", [("queue_depth", 7, {"model": "m"})])
                await asyncio.sleep(0.1)
                if got:
                    break
        finally:
            await second.stop()
    finally:
        await asyncio.to_thread(subscription.close)
    assert got and set(got) == {7}


async def test_model_statistics_over_grpc(server: MetricsServer) -> None:
    await report(
        server,
        "gateway",
        [
            ("requests", 1, {"model": "double", "code": "ok"}),
            ("requests", 1, {"model": "double", "code": "unavailable"}),
            ("e2e_latency_ms", 3.0, {"model": "double", "code": "ok"}),
        ],
    )
    await report(
        server,
        "model-pool",
        [("inference_latency_ms", 1.5, {"model": "double"}), ("batch_size", 1, {"model": "double"})],
    )
    async with aio_channel(f"127.0.0.1:{server.port}") as channel:
        stub = metrics_pb2_grpc.MetricsServiceStub(channel)
        reply = await stub.GetModelStatistics(metrics_pb2.GetModelStatisticsRequest(), timeout=5)
        [double] = reply.models
        assert (double.model_id, double.success_count, double.failure_count) == ("double", 1, 1)
        assert dict(double.failures_by_code) == {"unavailable": 1}
        assert (double.success.count, double.success.total_ms) == (1, 3.0)
        assert (double.compute.count, double.compute.total_ms, double.execution_count) == (1, 1.5, 1)
        assert [(b.batch_size, b.count) for b in double.batch_stats] == [(1, 1)]
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.GetModelStatistics(metrics_pb2.GetModelStatisticsRequest(window_s=-1), timeout=5)
        assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "window_s" in error.value.details()


async def test_dashboard_page_and_json_over_http(server: MetricsServer) -> None:
    await report(
        server,
        "gateway",
        [
            ("requests", 1, {"model": "double", "code": "ok"}),
            ("e2e_latency_ms", 4.0, {"model": "double", "code": "ok"}),
        ],
    )
    await report(server, "model-pool", [("slot_state", 1, {"model": "double", "state": "ready"})])
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}", trust_env=False) as client:
        page = await client.get("/", timeout=5)
        assert page.status_code == 200 and "<canvas" in page.text
        doc = (await client.get("/api/dashboard", timeout=5)).json()
    assert doc["models"]["double"]["summary"]["p50_ms"] == 4.0
    assert sum(doc["models"]["double"]["throughput_rps"]) == 1.0
    assert doc["workers"] == [
        {
            "worker_id": "model-pool",
            "slots": [{"model": "double", "state": "READY", "inflight": 0, "vram_mb": 0}],
        }
    ]


async def test_on_metric_gives_up_a_connection_whose_handshake_hangs() -> None:
    # A listener that accepts and then never answers (as a server stopping mid-accept can):
    # the watch must give the connection up and reach the real service on the same port
    # within seconds, not after gRPC's default 20 s connect timeout.
    hung = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    hung.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    port = hung.getsockname()[1]
    subscription = on_metric(lambda s: None, address=f"127.0.0.1:{port}")
    accepted: list[socket.socket] = []
    try:
        conn, _ = await asyncio.to_thread(hung.accept)  # the watch's connection, left unanswered
        accepted.append(conn)
        hung.close()
        settings = Settings(metrics=MetricsSettings(address=f"127.0.0.1:{port}", http_port=0))
        server = await build(settings)
        await server.start()
        try:
            assert await asyncio.to_thread(subscription.wait_ready, 8)
        finally:
            await server.stop()
    finally:
        await asyncio.to_thread(subscription.close)
        for conn in accepted:
            conn.close()
        hung.close()


async def test_on_metric_gives_up_a_watch_the_service_never_confirms() -> None:
    # A service that takes the Watch and never sends its headers (as one shutting down was
    # seen to do): the subscription must give it up and try again, not wait forever.
    calls = 0

    class Silent(metrics_pb2_grpc.MetricsServiceServicer):
        async def Watch(  # noqa: N802
            self, request: metrics_pb2.MetricsServiceWatchRequest, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[metrics_pb2.MetricsServiceWatchResponse]:
            nonlocal calls
            calls += 1
            await asyncio.Event().wait()
            yield metrics_pb2.MetricsServiceWatchResponse()  # never reached

    server = grpc.aio.server()
    metrics_pb2_grpc.add_MetricsServiceServicer_to_server(Silent(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    subscription = on_metric(lambda s: None, address=f"127.0.0.1:{port}", ready_timeout_s=0.3)
    try:
        for _ in range(50):  # 5 s at most
            if calls >= 2:
                break
            await asyncio.sleep(0.1)
        assert calls >= 2
        assert not subscription.wait_ready(0)
    finally:
        await asyncio.to_thread(subscription.close)
        await server.stop(None)
