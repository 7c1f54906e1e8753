"""`loadmaster.v1.MetricsService` over gRPC: protobuf <-> hub values, nothing else."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

import grpc

from loadmaster.common.errors import UnavailableError
from loadmaster.common.streams import until_set
from loadmaster.metrics.hub import MetricsHub
from loadmaster.metrics.model_stats import DurationTotal, ModelStatistics
from loadmaster.metrics.windows import Observations, Sample, WindowStats, label_set, observations_of
from loadmaster.v1 import metrics_pb2, metrics_pb2_grpc

__all__ = [
    "MetricsServiceServicer",
    "model_statistics_to_proto",
    "observations_from_batch",
    "sample_to_proto",
    "stats_to_proto",
]


def observations_from_batch(batch: metrics_pb2.ReportRequest) -> list[Observations]:
    """The batch's series, then its one-message-per-sample `samples` (older reporters)
    grouped per series; every label set gets the reporting `service`."""
    service = batch.service
    found = [
        Observations(
            s.name,
            label_set(s.labels, service=service),
            list(s.values),
            _timestamps(s),
        )
        for s in batch.series
    ]
    if batch.samples:
        found += observations_of(
            Sample(s.name, s.value, label_set(s.labels, service=service), s.timestamp_unix_ns)
            for s in batch.samples
        )
    return found


def _timestamps(series: metrics_pb2.SampleSeries) -> list[int]:
    """Absolute timestamps from the deltas; zeros (unknown) when there are none."""
    if not series.timestamp_deltas_ns:
        return [0] * len(series.values)
    return list(itertools.accumulate(series.timestamp_deltas_ns))


def sample_to_proto(sample: Sample) -> metrics_pb2.Sample:
    return metrics_pb2.Sample(
        name=sample.name,
        value=sample.value,
        labels=dict(sample.labels),
        timestamp_unix_ns=sample.timestamp_unix_ns,
    )


def stats_to_proto(stats: WindowStats) -> metrics_pb2.Stats:
    return metrics_pb2.Stats(
        count=stats.count,
        mean=stats.mean,
        min=stats.min,
        p50=stats.p50,
        p95=stats.p95,
        p99=stats.p99,
        max=stats.max,
        sum=stats.sum,
    )


def model_statistics_to_proto(stats: ModelStatistics) -> metrics_pb2.ModelStatistics:
    def duration(total: DurationTotal) -> metrics_pb2.DurationTotal:
        return metrics_pb2.DurationTotal(count=total.count, total_ms=total.total_ms)

    return metrics_pb2.ModelStatistics(
        model_id=stats.model_id,
        success_count=stats.success_count,
        failure_count=stats.failure_count,
        failures_by_code=stats.failures_by_code,
        success=duration(stats.success),
        failure=duration(stats.failure),
        queue=duration(stats.queue),
        compute=duration(stats.compute),
        inference_count=stats.inference_count,
        execution_count=stats.execution_count,
        batch_stats=[
            metrics_pb2.BatchStatistics(batch_size=b.batch_size, count=b.count) for b in stats.batch_stats
        ],
        last_inference_unix_ns=stats.last_inference_unix_ns,
    )


class MetricsServiceServicer(metrics_pb2_grpc.MetricsServiceServicer):
    def __init__(self, hub: MetricsHub) -> None:
        self._hub = hub

    async def Report(  # noqa: N802 - gRPC method name
        self,
        request_iterator: AsyncIterator[metrics_pb2.ReportRequest],
        context: grpc.aio.ServicerContext,
    ) -> metrics_pb2.ReportResponse:
        accepted = 0
        async for batch in until_set(self._hub.closed, request_iterator):
            accepted += self._hub.ingest(
                observations_from_batch(batch), service=batch.service, instance=batch.instance
            )
        if self._hub.closed.is_set():
            # Reporters hold this stream open for their lifetime: end it now rather than
            # hold up shutdown for the grace period; UNAVAILABLE makes them reconnect later.
            raise UnavailableError("metrics service is stopping")
        return metrics_pb2.ReportResponse(accepted=accepted)

    async def GetStats(  # noqa: N802
        self, request: metrics_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> metrics_pb2.GetStatsResponse:
        stats = self._hub.stats(request.name, request.labels, window_s=request.window_s)
        return metrics_pb2.GetStatsResponse(stats=stats_to_proto(stats))

    async def GetLatest(  # noqa: N802
        self, request: metrics_pb2.GetLatestRequest, context: grpc.aio.ServicerContext
    ) -> metrics_pb2.GetLatestResponse:
        samples = self._hub.latest(request.name, request.labels)
        return metrics_pb2.GetLatestResponse(samples=[sample_to_proto(s) for s in samples])

    async def GetModelStatistics(  # noqa: N802
        self, request: metrics_pb2.GetModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> metrics_pb2.GetModelStatisticsResponse:
        models = self._hub.model_statistics(request.model_id, window_s=request.window_s)
        return metrics_pb2.GetModelStatisticsResponse(models=[model_statistics_to_proto(m) for m in models])

    async def Watch(  # noqa: N802
        self, request: metrics_pb2.MetricsServiceWatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[metrics_pb2.MetricsServiceWatchResponse]:
        with self._hub.watch(names=request.names, labels=request.labels) as subscription:
            # Headers go out once subscribed: a client that awaits them misses nothing after.
            await context.send_initial_metadata(())
            async for batch in subscription:  # one message per delivered batch, in order
                yield metrics_pb2.MetricsServiceWatchResponse(samples=[sample_to_proto(s) for s in batch])
