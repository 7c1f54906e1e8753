"""Per-model statistics for v2 `ModelStatistics` / `/v2/models/{m}/stats`, from the metrics service.

`to_v2` converts the metrics service's `ModelStatistics` into the v2 statistics
object as a JSON-shaped dict (the HTTP body as is; `ParseDict` into the gRPC
message). `StatisticsSource` makes the one gRPC call (`Metrics.GetModelStatistics`).
This module does not import the `inference` protos, so a process may load it next
to a stock client's copy of them.
"""

from __future__ import annotations

from typing import Any

import grpc

from loadmaster.common.errors import UnavailableError
from loadmaster.common.grpc_client import aio_channel
from loadmaster.common.retry import retry_options
from loadmaster.v1 import metrics_pb2, metrics_pb2_grpc

__all__ = ["StatisticsSource", "empty_v2", "to_v2"]


def _duration(count: int, total_ms: float) -> dict[str, int]:
    return {"count": int(count), "ns": int(total_ms * 1e6)}


def to_v2(stats: metrics_pb2.ModelStatistics) -> dict[str, Any]:
    """The v2 `ModelStatistics` of one model (integers as numbers; proto field names)."""
    compute = stats.compute
    infer_ms_per_call = compute.total_ms / compute.count if compute.count else 0.0
    return {
        "name": stats.model_id,
        "version": "1",
        "last_inference": stats.last_inference_unix_ns // 1_000_000,
        "inference_count": stats.inference_count,
        "execution_count": stats.execution_count,
        "inference_stats": {
            "success": _duration(stats.success.count, stats.success.total_ms),
            "fail": _duration(stats.failure.count, stats.failure.total_ms),
            "queue": _duration(stats.queue.count, stats.queue.total_ms),
            "compute_input": _duration(0, 0.0),
            "compute_infer": _duration(compute.count, compute.total_ms),
            "compute_output": _duration(0, 0.0),
        },
        "batch_stats": [
            {
                "batch_size": batch.batch_size,
                "compute_infer": _duration(batch.count, batch.count * infer_ms_per_call),
            }
            for batch in stats.batch_stats
        ],
    }


def empty_v2(model_id: str) -> dict[str, Any]:
    return to_v2(metrics_pb2.ModelStatistics(model_id=model_id))


class StatisticsSource:
    def __init__(self, metrics_address: str | None, *, timeout_s: float = 5.0) -> None:
        self._address = metrics_address
        self._timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None

    async def model_statistics(self, model_id: str = "") -> list[dict[str, Any]]:
        """Statistics of `model_id` (every reporting model when empty)."""
        if self._address is None:
            raise UnavailableError("the metrics service is disabled; no statistics are kept")
        if self._channel is None:
            self._channel = aio_channel(self._address, options=retry_options())
        stub = metrics_pb2_grpc.MetricsServiceStub(self._channel)
        try:
            reply = await stub.GetModelStatistics(
                metrics_pb2.GetModelStatisticsRequest(model_id=model_id), timeout=self._timeout_s
            )
        except grpc.aio.AioRpcError as error:
            raise UnavailableError(f"metrics service: {error.details() or error.code().name}") from None
        return [to_v2(stats) for stats in reply.models]

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
