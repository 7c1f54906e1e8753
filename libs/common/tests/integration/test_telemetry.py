"""TelemetryReporter against a small Metrics servicer over real gRPC, and against nothing at all."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from loadmaster.common.grpc_server import GrpcServer
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.v1 import metrics_pb2, metrics_pb2_grpc


def samples_of(batch: metrics_pb2.ReportRequest) -> list[metrics_pb2.Sample]:
    """The batch's series, one `Sample` per value, timestamps decoded from their deltas."""
    samples = []
    for series in batch.series:
        assert len(series.timestamp_deltas_ns) == len(series.values)
        timestamp = 0
        for value, delta in zip(series.values, series.timestamp_deltas_ns, strict=True):
            timestamp += delta
            samples.append(
                metrics_pb2.Sample(
                    name=series.name, value=value, labels=series.labels, timestamp_unix_ns=timestamp
                )
            )
    return samples


class CollectingMetrics(metrics_pb2_grpc.MetricsServiceServicer):
    def __init__(self) -> None:
        self.batches: list[metrics_pb2.ReportRequest] = []
        self.changed = asyncio.Event()

    async def Report(  # noqa: N802 - gRPC method names
        self, request_iterator: AsyncIterator[metrics_pb2.ReportRequest], context: grpc.aio.ServicerContext
    ) -> metrics_pb2.ReportResponse:
        accepted = 0
        async for batch in request_iterator:
            self.batches.append(batch)
            accepted += len(samples_of(batch))
            self.changed.set()
        return metrics_pb2.ReportResponse(accepted=accepted)

    @property
    def samples(self) -> list[metrics_pb2.Sample]:
        return [s for b in self.batches for s in samples_of(b)]

    async def wait_for(self, count: int, timeout_s: float = 5.0) -> None:
        async def wait() -> None:
            while len(self.samples) < count:
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(wait(), timeout_s)


@pytest.fixture()
async def metrics() -> AsyncIterator[tuple[CollectingMetrics, str]]:
    servicer = CollectingMetrics()
    server = GrpcServer("metrics-under-test", "127.0.0.1:0", grace_s=0.2)
    server.add_service(
        "loadmaster.v1.MetricsService", metrics_pb2_grpc.add_MetricsServiceServicer_to_server, servicer
    )
    port = await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop()


def unused_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"127.0.0.1:{port}"  # closed again: connecting is refused


async def test_samples_arrive_in_batches_with_their_labels(metrics: tuple[CollectingMetrics, str]) -> None:
    servicer, address = metrics
    reporter = TelemetryReporter(
        "gateway", "gw-1", address, flush_interval_s=0.01, max_batch=3, process_interval_s=None
    )
    reporter.start()
    before = time.time_ns()
    for value in range(7):
        reporter.record("e2e_latency_ms", value, {"model": "policy", "code": "ok"})
    await servicer.wait_for(7)  # delivered while running, not only on close
    assert [len(samples_of(b)) for b in servicer.batches] == [3, 3, 1]
    assert all(not b.samples and len(b.series) == 1 for b in servicer.batches)  # one series each
    assert {(b.service, b.instance) for b in servicer.batches} == {("gateway", "gw-1")}
    samples = servicer.samples
    assert [s.value for s in samples] == [float(v) for v in range(7)]
    assert {s.name for s in samples} == {"e2e_latency_ms"}
    assert all(dict(s.labels) == {"model": "policy", "code": "ok"} for s in samples)
    assert all(before <= s.timestamp_unix_ns <= time.time_ns() for s in samples)
    await reporter.close()
    assert (reporter.sent, reporter.dropped) == (7, 0)


async def test_close_flushes_what_is_buffered(metrics: tuple[CollectingMetrics, str]) -> None:
    servicer, address = metrics
    reporter = TelemetryReporter("scheduler", "s-1", address, flush_interval_s=10.0, process_interval_s=None)
    reporter.start()
    for value in range(5):
        reporter.record("queue_depth", value)
    await reporter.close(timeout_s=5.0)  # does not wait out the 10 s flush interval
    assert len(servicer.samples) == 5


async def test_an_unreachable_address_never_blocks_record() -> None:
    reporter = TelemetryReporter(
        "gateway", "gw-1", unused_address(), flush_interval_s=0.01, process_interval_s=None
    )
    reporter.start()
    started = time.perf_counter()
    for value in range(2000):
        reporter.record("requests", 1.0, {"value": str(value % 4)})
    assert time.perf_counter() - started < 0.5  # a dict update each, no network wait
    for _ in range(500):  # counters are summed per series: 4 of them, dropped once the send fails
        if reporter.dropped and not reporter._counts:
            break
        await asyncio.sleep(0.01)
    assert not reporter._counts  # nothing piles up while the address is unreachable
    await reporter.close(timeout_s=1.0)


async def test_an_unreachable_address_counts_what_it_drops() -> None:
    reporter = TelemetryReporter(
        "gateway", "gw-1", unused_address(), flush_interval_s=0.01, process_interval_s=None
    )
    reporter.start()
    for _ in range(100):
        reporter.record("e2e_latency_ms", 1.0)  # a histogram: one sample each
    for _ in range(500):
        if reporter.dropped + reporter.sent >= 100 and not reporter._series:
            break
        await asyncio.sleep(0.01)
    await reporter.close(timeout_s=1.0)
    assert (reporter.dropped, reporter.sent) == (100, 0)


async def test_a_steady_stream_of_samples_is_sent_once_per_flush_interval(
    metrics: tuple[CollectingMetrics, str],
) -> None:
    """Samples recorded while a batch is being written wait for the next flush: a steady
    stream must not turn into one tiny batch per write (that cost every service a stream
    write per request)."""
    servicer, address = metrics
    interval_s = 0.2
    reporter = TelemetryReporter(
        "scheduler", "s-1", address, flush_interval_s=interval_s, process_interval_s=None
    )
    reporter.start()
    started = time.perf_counter()
    for value in range(150):
        reporter.record("scheduling_wait_ms", value, {"model": "policy"})
        await asyncio.sleep(0.005)
    elapsed = time.perf_counter() - started
    await servicer.wait_for(150)
    assert len(servicer.batches) <= elapsed / interval_s + 2
    assert [s.value for s in servicer.samples] == [float(v) for v in range(150)]
    await reporter.close()


async def test_a_metrics_service_that_starts_late_gets_every_later_sample() -> None:
    """Failed Report calls must not leave readers behind that swallow later batches (the
    gpu-broker starts before the metrics service and records a gauge only every 15 s)."""
    address = unused_address()
    reporter = TelemetryReporter("gpu-broker", "b-1", address, flush_interval_s=0.01, process_interval_s=None)
    reporter.start()
    reporter.record("lease_mb", 1.0, {"gpu": "0"})  # dropped: nothing listens yet
    for _ in range(200):  # a few failed attempts (backoff 0.1 s, doubling)
        if reporter.dropped:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.4)
    assert reporter.dropped == 1
    servicer = CollectingMetrics()
    server = GrpcServer("metrics-late", address, grace_s=0.2)
    server.add_service(
        "loadmaster.v1.MetricsService", metrics_pb2_grpc.add_MetricsServiceServicer_to_server, servicer
    )
    await server.start()
    try:
        for value in range(2, 6):  # one at a time, each flushed on its own
            reporter.record("lease_mb", float(value), {"gpu": "0"})
            await servicer.wait_for(value - 1, timeout_s=10.0)
        assert [s.value for s in servicer.samples] == [2.0, 3.0, 4.0, 5.0]
    finally:
        await reporter.close()
        await server.stop()


async def test_the_loop_probe_reports_a_stall(metrics: tuple[CollectingMetrics, str]) -> None:
    """`event_loop_lag_ms`: a loop held 300 ms reads as a lag of about that once its second is
    up (the probe's wake-ups an idle process pays are counted by bench/idle_probe.py)."""
    servicer, address = metrics
    reporter = TelemetryReporter(
        "gateway", "gw-1", address, flush_interval_s=0.05, process_interval_s=60.0, loop_lag_tick_s=0.05
    )
    reporter.start()
    await asyncio.sleep(0.2)
    time.sleep(0.3)  # the loop is held: no timer of it fires
    lags: list[float] = []
    for _ in range(300):  # bounded: 3 s
        lags = [s.value for s in servicer.samples if s.name == "event_loop_lag_ms"]
        if any(lag >= 200.0 for lag in lags):
            break
        await asyncio.sleep(0.01)
    await reporter.close()
    assert any(250.0 <= lag <= 1000.0 for lag in lags), lags


async def test_unreachable_metrics_warn_only_after_the_start_window(caplog: pytest.LogCaptureFixture) -> None:
    """Services start together, so the metrics service may not listen yet for a first report:
    debug then; the same failure once the start window is over is a warning."""
    reporter = TelemetryReporter(
        "gpu-broker", "b-1", unused_address(), flush_interval_s=0.01, process_interval_s=None
    )
    with caplog.at_level(logging.DEBUG, logger="loadmaster.common.telemetry"):
        reporter.start()
        reporter.record("lease_mb", 1.0)
        for _ in range(300):  # bounded: 3 s
            if reporter.dropped:
                break
            await asyncio.sleep(0.01)
        assert reporter.dropped == 1
        assert [r.levelno for r in caplog.records if "unreachable" in r.getMessage()] == [logging.DEBUG]
        reporter._quiet_until = 0.0  # the start window is over
        reporter.record("lease_mb", 2.0)
        for _ in range(600):  # bounded: 6 s (the reconnect backoff doubles)
            if reporter.dropped == 2:
                break
            await asyncio.sleep(0.01)
        await reporter.close(timeout_s=1.0)
    levels = [r.levelno for r in caplog.records if "unreachable" in r.getMessage()]
    assert reporter.dropped == 2 and logging.WARNING in levels, levels
