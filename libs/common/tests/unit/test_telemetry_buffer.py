"""TelemetryReporter's hot path without a network: recording is bounded, grouped per series
and never needs a loop."""

from __future__ import annotations

import threading
import time

from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.v1 import metrics_pb2

Flat = tuple[str, float, dict[str, str], int]


def flatten(batch: metrics_pb2.ReportRequest) -> list[Flat]:
    """(name, value, labels, timestamp) per value of the batch's series, deltas decoded."""
    assert not batch.samples  # the one-message-per-sample field is for older reporters only
    found = []
    for series in batch.series:
        assert len(series.timestamp_deltas_ns) == len(series.values)
        timestamp = 0
        for value, delta in zip(series.values, series.timestamp_deltas_ns, strict=True):
            timestamp += delta
            found.append((series.name, value, dict(series.labels), timestamp))
    return found


def test_record_without_an_address_is_a_no_op() -> None:
    reporter = TelemetryReporter("gateway", "gw-1", None)
    reporter.record("requests", 1.0)
    reporter.start()  # nothing to ship to: no task, no error (and no running loop needed)
    assert (reporter.dropped, reporter.sent) == (0, 0)


def test_a_series_is_sent_once_with_its_values_timestamps_and_labels() -> None:
    reporter = TelemetryReporter("gateway", "gw-1", "metrics:50054")
    before = time.time_ns()
    for value in range(5):
        reporter.record("e2e_latency_ms", value, {"model": "m", "code": "ok"})
        reporter.record("payload_size_bytes", 100 + value, {"model": "m"})
    reporter.record("e2e_latency_ms", 9, {"model": "m", "code": "expired"})
    after = time.time_ns()

    batch = reporter._take_batch()

    assert (batch.service, batch.instance) == ("gateway", "gw-1")
    assert [(s.name, dict(s.labels), list(s.values)) for s in batch.series] == [
        ("e2e_latency_ms", {"model": "m", "code": "ok"}, [0.0, 1.0, 2.0, 3.0, 4.0]),
        ("payload_size_bytes", {"model": "m"}, [100.0, 101.0, 102.0, 103.0, 104.0]),
        ("e2e_latency_ms", {"model": "m", "code": "expired"}, [9.0]),
    ]
    stamps = [timestamp for _, _, _, timestamp in flatten(batch)[:5]]
    assert before <= stamps[0] and stamps == sorted(stamps) and stamps[-1] <= after
    assert reporter._take_batch() == metrics_pb2.ReportRequest(service="gateway", instance="gw-1")


def test_the_buffer_is_bounded_and_keeps_each_series_newest_samples() -> None:
    reporter = TelemetryReporter("gateway", "gw-1", "metrics:50054", max_buffer=10)
    for value in range(15):
        reporter.record("e2e_latency_ms", value, {"model": "m"})
    reporter.record("queue_depth", 1.0)  # a new series while full: nothing of its own to replace
    assert reporter.dropped == 6
    samples = flatten(reporter._take_batch())
    assert [value for _, value, _, _ in samples] == [float(v) for v in range(5, 15)]
    assert all(labels == {"model": "m"} and timestamp > 0 for _, _, labels, timestamp in samples)
    reporter.record("queue_depth", 2.0)  # room again after the batch
    assert [value for _, value, _, _ in flatten(reporter._take_batch())] == [2.0]


def test_batches_are_capped_at_max_batch_splitting_a_series_in_order() -> None:
    reporter = TelemetryReporter("scheduler", "s-1", "metrics:50054", max_batch=4)
    for value in range(3):
        reporter.record("scheduling_wait_ms", value, {"model": "a"})
    for value in range(7):
        reporter.record("queue_depth", value, {"model": "a"})
    batches = []
    while reporter._pending():
        batches.append(flatten(reporter._take_batch()))
    assert [len(batch) for batch in batches] == [4, 4, 2]
    samples = [sample for batch in batches for sample in batch]
    assert [(name, value) for name, value, _, _ in samples] == [
        *(("scheduling_wait_ms", float(v)) for v in range(3)),
        *(("queue_depth", float(v)) for v in range(7)),
    ]
    stamps = [timestamp for name, _, _, timestamp in samples if name == "queue_depth"]
    assert stamps == sorted(stamps)  # the deltas of a split series start again from its own first


def test_counters_are_summed_per_series_until_the_next_batch() -> None:
    reporter = TelemetryReporter("gateway", "gw-1", "metrics:50054")
    for _ in range(100):
        reporter.record("requests", 1.0, {"model": "m", "code": "ok"})
        reporter.record("e2e_latency_ms", 2.0, {"model": "m", "code": "ok"})  # a histogram: kept
    for _ in range(3):
        reporter.record("requests", 1.0, {"code": "expired", "model": "m"})  # label order is irrelevant
    reporter.record("requests", 1.0, {"model": "m", "code": "expired"})
    reporter.record("send_errors", 2.0)
    batch = reporter._take_batch()
    counters = {
        (s.name, tuple(sorted(s.labels.items()))): list(s.values)
        for s in batch.series
        if s.name != "e2e_latency_ms"
    }
    assert counters == {
        ("requests", (("code", "ok"), ("model", "m"))): [100.0],
        ("requests", (("code", "expired"), ("model", "m"))): [4.0],
        ("send_errors", ()): [2.0],
    }
    assert sum(1 for name, *_ in flatten(batch) if name == "e2e_latency_ms") == 100
    assert not reporter._take_batch().series  # nothing left over


def test_records_from_many_threads_arrive_once_each_in_order_per_thread() -> None:
    """Batches taken while threads record lose and repeat nothing."""
    reporter = TelemetryReporter("model-pool", "w-1", "metrics:50054", max_batch=500)
    threads = [
        threading.Thread(
            target=lambda worker=worker: [
                reporter.record(
                    "inference_latency_ms", value, {"model": f"m{worker % 2}", "worker": str(worker)}
                )
                for value in range(5_000)
            ]
        )
        for worker in range(4)
    ]
    for thread in threads:
        thread.start()
    samples: list[Flat] = []
    while any(thread.is_alive() for thread in threads) or reporter._pending():
        samples += flatten(reporter._take_batch())
    for thread in threads:
        thread.join()

    assert reporter.dropped == 0
    for worker in range(4):
        values = [value for _, value, labels, _ in samples if labels["worker"] == str(worker)]
        assert values == [float(v) for v in range(5_000)]
