"""Both report formats against the metrics service in-process on 127.0.0.1:0: the packed
series a reporter sends now, and the one-message-per-sample batches of older reporters."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.metrics.server import MetricsServer
from loadmaster.v1 import metrics_pb2, metrics_pb2_grpc


async def test_a_series_with_several_values_arrives_with_values_timestamps_and_labels(
    server: MetricsServer, stub: metrics_pb2_grpc.MetricsServiceStub
) -> None:
    watch = stub.Watch(metrics_pb2.MetricsServiceWatchRequest(names=["e2e_latency_ms"]))
    await asyncio.wait_for(watch.initial_metadata(), 5.0)  # subscribed from here on
    reporter = TelemetryReporter(
        "gateway", "gw-1", f"127.0.0.1:{server.port}", flush_interval_s=10.0, process_interval_s=None
    )
    reporter.start()
    stamps = []
    for value in range(6):
        stamps.append(time.time_ns())
        reporter.record("e2e_latency_ms", 1.5 * value, {"model": "m", "code": "ok"})
        stamps.append(time.time_ns())
    await reporter.close(timeout_s=10.0)  # one batch: the flush interval is far off
    assert (reporter.sent, reporter.dropped) == (6, 0)

    watched: list[metrics_pb2.Sample] = []
    for _ in range(6):  # the six may come in one message or several
        if len(watched) == 6:
            break
        watched.extend((await asyncio.wait_for(watch.read(), 5.0)).samples)
    watch.cancel()
    assert [(s.name, s.value, dict(s.labels)) for s in watched] == [
        ("e2e_latency_ms", 1.5 * v, {"model": "m", "code": "ok", "service": "gateway"}) for v in range(6)
    ]
    for index, sample in enumerate(watched):  # each value keeps its own reporter timestamp
        assert stamps[2 * index] <= sample.timestamp_unix_ns <= stamps[2 * index + 1]
    latest = await stub.GetLatest(metrics_pb2.GetLatestRequest(name="e2e_latency_ms"))
    assert [s.timestamp_unix_ns for s in latest.samples] == [watched[-1].timestamp_unix_ns]
    stats = (
        await stub.GetStats(metrics_pb2.GetStatsRequest(name="e2e_latency_ms", labels={"model": "m"}))
    ).stats
    assert (stats.count, stats.sum, stats.max, stats.p50) == (6, 22.5, 7.5, 3.75)


async def test_old_format_batches_still_ingest_beside_series(
    stub: metrics_pb2_grpc.MetricsServiceStub,
) -> None:
    old = metrics_pb2.ReportRequest(service="model-pool", instance="w-1")
    for value in (1.0, 4.0, float("nan")):
        old.samples.add(name="batch_size", value=value, labels={"model": "m"}, timestamp_unix_ns=1_000)
    both = metrics_pb2.ReportRequest(service="model-pool", instance="w-1")
    both.samples.add(name="batch_size", value=2.0, labels={"model": "m"}, timestamp_unix_ns=2_000)
    both.series.add(
        name="batch_size", labels={"model": "m"}, values=[8.0, 16.0], timestamp_deltas_ns=[3_000, 5]
    )

    async def batches() -> AsyncIterator[metrics_pb2.ReportRequest]:
        yield old
        yield both

    assert (await stub.Report(batches())).accepted == 5

    stats = (await stub.GetStats(metrics_pb2.GetStatsRequest(name="batch_size"))).stats
    assert (stats.count, stats.sum) == (5, 31.0)
    [latest] = (await stub.GetLatest(metrics_pb2.GetLatestRequest(name="batch_size"))).samples
    # a batch's series come before its old-style samples
    assert (latest.value, latest.timestamp_unix_ns, dict(latest.labels)) == (
        2.0,
        2_000,
        {"model": "m", "service": "model-pool"},
    )
    [model] = (await stub.GetModelStatistics(metrics_pb2.GetModelStatisticsRequest(model_id="m"))).models
    assert (model.execution_count, model.inference_count) == (5, 31)
    assert [(b.batch_size, b.count) for b in model.batch_stats] == [(1, 1), (2, 1), (4, 1), (8, 1), (16, 1)]
