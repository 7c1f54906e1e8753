"""The metrics service in-process on 127.0.0.1:0: reporters in, gRPC queries and /metrics out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadmaster.common.config import Settings
from loadmaster.common.grpc_client import aio_channel, check_health
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.metrics.server import SERVICE_NAME, MetricsServer, build
from loadmaster.v1 import metrics_pb2, metrics_pb2_grpc


async def report(
    server: MetricsServer, service: str, samples: list[tuple[str, float, dict[str, str]]]
) -> None:
    """Send samples through the real reporter; returns once the server acknowledged them."""
    reporter = TelemetryReporter(
        service, f"{service}-1", f"127.0.0.1:{server.port}", flush_interval_s=0.01, process_interval_s=None
    )
    reporter.start()
    for name, value, labels in samples:
        reporter.record(name, value, labels)
    await reporter.close(timeout_s=10.0)
    assert (reporter.sent, reporter.dropped) == (len(samples), 0)


async def scrape(server: MetricsServer, path: str = "/metrics") -> httpx.Response:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}", trust_env=False) as client:
        return await client.get(path, timeout=5.0)


async def test_reported_samples_answer_stats_latest_and_prometheus(
    server: MetricsServer, stub: metrics_pb2_grpc.MetricsServiceStub
) -> None:
    latencies = np.random.default_rng(3).gamma(shape=2.0, scale=1.5, size=300)
    samples = [("e2e_latency_ms", float(v), {"model": "m1", "code": "ok"}) for v in latencies]
    samples += [("e2e_latency_ms", 50.0, {"model": "m2", "code": "expired"})] * 20
    samples += [("active_clients", 3.0, {}), ("active_clients", 5.0, {})]
    await report(server, "gateway", samples)
    await report(server, "scheduler", [("queue_depth", 7.0, {"model": "m1"})])

    reply = await stub.GetStats(
        metrics_pb2.GetStatsRequest(name="e2e_latency_ms", labels={"model": "m1"}, window_s=60.0)
    )
    p50, p95, p99 = np.percentile(latencies, [50, 95, 99])
    assert reply.stats.count == 300
    assert (reply.stats.p50, reply.stats.p95, reply.stats.p99) == pytest.approx((p50, p95, p99))
    assert reply.stats.max == pytest.approx(latencies.max())
    everything = await stub.GetStats(
        metrics_pb2.GetStatsRequest(name="e2e_latency_ms", labels={"service": "gateway"})
    )
    assert everything.stats.count == 320

    latest = await stub.GetLatest(metrics_pb2.GetLatestRequest(name="active_clients"))
    assert [(s.value, dict(s.labels)) for s in latest.samples] == [(5.0, {"service": "gateway"})]
    assert latest.samples[0].timestamp_unix_ns > 0
    by_service = await stub.GetLatest(metrics_pb2.GetLatestRequest(labels={"service": "scheduler"}))
    assert [(s.name, s.value) for s in by_service.samples] == [("queue_depth", 7.0)]

    response = await scrape(server)
    assert response.status_code == 200
    seen = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }
    ok = (("code", "ok"), ("model", "m1"), ("replica", "gateway-1"))
    assert seen[("loadmaster_gateway_e2e_latency_seconds_count", ok)] == 300
    assert seen[("loadmaster_gateway_e2e_latency_seconds_sum", ok)] == pytest.approx(latencies.sum() / 1000)
    assert (
        seen[
            (
                "loadmaster_gateway_e2e_latency_seconds_count",
                (("code", "expired"), ("model", "m2"), ("replica", "gateway-1")),
            )
        ]
        == 20
    )
    assert seen[("loadmaster_gateway_active_clients", (("replica", "gateway-1"),))] == 5.0
    assert seen[("loadmaster_scheduler_queue_depth", (("model", "m1"), ("replica", "scheduler-1")))] == 7.0
    assert seen[("loadmaster_metrics_samples_accepted_total", (("service", "gateway"),))] == 322


async def test_watch_receives_new_samples(
    server: MetricsServer, stub: metrics_pb2_grpc.MetricsServiceStub
) -> None:
    call = stub.Watch(metrics_pb2.MetricsServiceWatchRequest(names=["queue_depth"], labels={"model": "m1"}))
    await asyncio.wait_for(call.initial_metadata(), 5.0)  # subscribed from here on

    await report(
        server,
        "scheduler",
        [
            ("queue_depth", 1.0, {"model": "m2"}),
            ("grants", 1.0, {"model": "m1"}),
            ("queue_depth", 4.0, {"model": "m1"}),
        ],
    )

    (sample,) = (await asyncio.wait_for(call.read(), 5.0)).samples  # only the matching one
    assert (sample.name, sample.value, dict(sample.labels)) == (
        "queue_depth",
        4.0,
        {"model": "m1", "service": "scheduler"},
    )
    call.cancel()


async def test_report_acks_accepted_count_and_bad_queries_are_invalid_argument(
    stub: metrics_pb2_grpc.MetricsServiceStub,
) -> None:
    batch = metrics_pb2.ReportRequest(service="model-pool", instance="w-1")
    batch.samples.add(name="batch_size", value=4)
    batch.samples.add(name="batch_size", value=float("nan"))
    batch.samples.add(name="", value=1)

    async def batches() -> AsyncIterator[metrics_pb2.ReportRequest]:
        yield batch
        yield batch

    ack = await stub.Report(batches())
    assert ack.accepted == 2

    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.GetStats(metrics_pb2.GetStatsRequest(name=""))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.GetStats(metrics_pb2.GetStatsRequest(name="batch_size", window_s=-1))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_health_over_grpc_and_http(server: MetricsServer) -> None:
    async with aio_channel(f"127.0.0.1:{server.port}") as channel:
        assert await check_health(channel, SERVICE_NAME)
    response = await scrape(server, "/healthz")
    assert (response.status_code, response.json()) == (200, {"status": "SERVING"})


async def test_stop_ends_watch_and_report_streams_and_http(metrics_settings: Settings) -> None:
    server = await build(metrics_settings)
    await server.start()
    http_port = server.http_port
    assert http_port
    hold_open = asyncio.Event()

    async def batches() -> AsyncIterator[metrics_pb2.ReportRequest]:
        batch = metrics_pb2.ReportRequest(service="gateway")
        batch.samples.add(name="active_clients", value=1)
        yield batch
        await hold_open.wait()  # a reporter keeps its stream open for its lifetime

    async with aio_channel(f"127.0.0.1:{server.port}") as channel:
        stub = metrics_pb2_grpc.MetricsServiceStub(channel)
        watch = stub.Watch(metrics_pb2.MetricsServiceWatchRequest())
        await asyncio.wait_for(watch.initial_metadata(), 5.0)
        report = stub.Report(batches())
        assert (await asyncio.wait_for(watch.read(), 5.0)).samples[0].name == "active_clients"

        await asyncio.wait_for(server.stop(), 4.0)  # well under the 5 s gRPC grace period

        assert await asyncio.wait_for(watch.code(), 2.0) == grpc.StatusCode.OK
        assert await asyncio.wait_for(report.code(), 2.0) == grpc.StatusCode.UNAVAILABLE
        hold_open.set()
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(trust_env=False) as client:
            await client.get(f"http://127.0.0.1:{http_port}/healthz", timeout=2.0)
