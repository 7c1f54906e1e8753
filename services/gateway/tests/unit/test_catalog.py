"""Model views from ListWorkers, and v2 statistics from the metrics service's."""

from __future__ import annotations

from loadmaster.gateway.catalog import summarize
from loadmaster.gateway.statistics import empty_v2, to_v2
from loadmaster.v1 import metrics_pb2, model_pool_pb2, scheduler_pb2

READY = model_pool_pb2.MODEL_STATE_READY
LOADING = model_pool_pb2.MODEL_STATE_LOADING


def _slot(model: str, state: int, **extra: object) -> model_pool_pb2.ModelSlotStatus:
    return model_pool_pb2.ModelSlotStatus(model_id=model, state=state, backend="python", **extra)  # type: ignore[arg-type]


def test_summarize_prefers_ready_and_lists_the_repository() -> None:
    workers = [
        scheduler_pb2.WorkerInfo(
            worker_id="w1",
            repository=["a", "b", "c"],
            models=[_slot("a", LOADING), _slot("b", READY, max_inflight=2)],
        ),
        scheduler_pb2.WorkerInfo(
            worker_id="w2", repository=["a"], models=[_slot("a", READY, max_inflight=4)]
        ),
    ]
    views = summarize(workers)
    assert list(views) == ["a", "b", "c"]
    assert views["a"].ready and views["a"].workers == ("w2",) and views["a"].max_inflight == 4
    assert views["b"].state == "READY" and views["b"].backend == "python"
    assert views["c"].state == "UNAVAILABLE" and views["c"].reason == "not loaded"


def test_summarize_loading_and_errors() -> None:
    workers = [
        scheduler_pb2.WorkerInfo(
            worker_id="w1",
            repository=["a", "b"],
            models=[_slot("a", LOADING), _slot("b", model_pool_pb2.MODEL_STATE_IDLE, error="out of memory")],
        )
    ]
    views = summarize(workers)
    assert views["a"].state == "LOADING" and not views["a"].ready
    assert views["b"].state == "UNAVAILABLE" and views["b"].reason == "out of memory"
    assert summarize([]) == {}


def test_statistics_in_v2_shape() -> None:
    stats = metrics_pb2.ModelStatistics(
        model_id="double",
        success_count=3,
        success=metrics_pb2.DurationTotal(count=3, total_ms=1.5),
        failure=metrics_pb2.DurationTotal(count=1, total_ms=2.0),
        queue=metrics_pb2.DurationTotal(count=4, total_ms=0.4),
        compute=metrics_pb2.DurationTotal(count=2, total_ms=1.0),
        inference_count=3,
        execution_count=2,
        batch_stats=[
            metrics_pb2.BatchStatistics(batch_size=1, count=1),
            metrics_pb2.BatchStatistics(batch_size=2, count=1),
        ],
        last_inference_unix_ns=1_700_000_000_123_000_000,
    )
    v2 = to_v2(stats)
    assert v2["name"] == "double" and v2["last_inference"] == 1_700_000_000_123
    assert v2["inference_stats"]["success"] == {"count": 3, "ns": 1_500_000}
    assert v2["inference_stats"]["fail"] == {"count": 1, "ns": 2_000_000}
    assert v2["inference_stats"]["compute_infer"] == {"count": 2, "ns": 1_000_000}
    assert [b["batch_size"] for b in v2["batch_stats"]] == [1, 2]
    assert v2["batch_stats"][1]["compute_infer"] == {"count": 1, "ns": 500_000}
    assert empty_v2("m")["inference_stats"]["success"] == {"count": 0, "ns": 0}
