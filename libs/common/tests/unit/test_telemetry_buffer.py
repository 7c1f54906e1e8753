"""TelemetryReporter's hot path without a network: recording is bounded and never needs a loop."""

from __future__ import annotations

from loadmaster.common.telemetry import TelemetryReporter


def test_record_without_an_address_is_a_no_op() -> None:
    reporter = TelemetryReporter("gateway", "gw-1", None)
    reporter.record("requests", 1.0)
    reporter.start()  # nothing to ship to: no task, no error (and no running loop needed)
    assert (reporter.dropped, reporter.sent) == (0, 0)


def test_the_buffer_is_bounded_and_keeps_the_newest_samples() -> None:
    reporter = TelemetryReporter("gateway", "gw-1", "metrics:50054", max_buffer=10)
    for value in range(15):
        reporter.record("e2e_latency_ms", value, {"model": "m"})
    assert reporter.dropped == 5
    batch = reporter._take_batch()
    assert [s.value for s in batch.samples] == [float(v) for v in range(5, 15)]
    assert (batch.service, batch.instance) == ("gateway", "gw-1")
    assert all(dict(s.labels) == {"model": "m"} and s.timestamp_unix_ns > 0 for s in batch.samples)


def test_batches_are_capped_at_max_batch() -> None:
    reporter = TelemetryReporter("scheduler", "s-1", "metrics:50054", max_batch=4)
    for value in range(10):
        reporter.record("queue_depth", value)
    sizes = []
    while reporter._buffer:
        sizes.append(len(reporter._take_batch().samples))
    assert sizes == [4, 4, 2]


def test_counters_are_summed_per_series_until_the_next_batch() -> None:
    reporter = TelemetryReporter("gateway", "gw-1", "metrics:50054")
    for _ in range(100):
        reporter.record("requests", 1.0, {"model": "m", "code": "ok"})
        reporter.record("e2e_latency_ms", 2.0, {"model": "m", "code": "ok"})  # a histogram: kept
    for _ in range(3):
        reporter.record("requests", 1.0, {"code": "expired", "model": "m"})  # label order is irrelevant
    reporter.record("send_errors", 2.0)
    batch = reporter._take_batch()
    counters = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for s in batch.samples
        if s.name != "e2e_latency_ms"
    }
    assert counters == {
        ("requests", (("code", "ok"), ("model", "m"))): 100.0,
        ("requests", (("code", "expired"), ("model", "m"))): 3.0,
        ("send_errors", ()): 2.0,
    }
    assert sum(1 for s in batch.samples if s.name == "e2e_latency_ms") == 100
    assert len(reporter._take_batch().samples) == 0  # nothing left over
