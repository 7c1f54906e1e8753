from __future__ import annotations

import numpy as np
import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.metrics.windows import Sample, Series, Windows, WindowStats, label_set, observations_of


def sample(name: str, value: float, ts_ns: int = 0, **labels: str) -> Sample:
    labels.setdefault("service", "gateway")
    return Sample(name, value, label_set(labels), ts_ns)


def make(ring_size: int = 1000, **kwargs: int) -> tuple[Windows, FakeClock]:
    clock = FakeClock()
    return Windows(ring_size=ring_size, clock=clock, **kwargs), clock


def test_stats_match_numpy_on_known_data() -> None:
    windows, _ = make()
    values = np.random.default_rng(7).lognormal(mean=1.0, sigma=0.8, size=500)
    windows.ingest(observations_of([sample("e2e_latency_ms", float(v), model="m") for v in values]))

    stats = windows.stats("e2e_latency_ms")

    assert stats.count == 500
    assert stats.sum == pytest.approx(values.sum())
    assert stats.mean == pytest.approx(values.mean())
    assert stats.min == values.min()
    assert stats.max == values.max()
    p50, p95, p99 = np.percentile(values, [50, 95, 99])
    assert (stats.p50, stats.p95, stats.p99) == pytest.approx((p50, p95, p99))


def test_percentiles_of_one_to_hundred() -> None:
    windows, _ = make()
    windows.ingest(observations_of([sample("x", float(v)) for v in range(1, 101)]))
    stats = windows.stats("x")
    assert (stats.p50, stats.p95, stats.p99) == pytest.approx((50.5, 95.05, 99.01))


def test_window_keeps_only_recent_samples() -> None:
    windows, clock = make()
    windows.ingest(observations_of([sample("x", 1.0), sample("x", 2.0)]))
    clock.advance(5.0)
    windows.ingest(observations_of([sample("x", 10.0)]))
    clock.advance(5.0)
    windows.ingest(observations_of([sample("x", 100.0)]))

    assert windows.stats("x", window_s=1.0).count == 1
    assert windows.stats("x", window_s=1.0).max == 100.0
    assert windows.stats("x", window_s=5.0) == WindowStats.of(np.array([10.0, 100.0]))
    assert windows.stats("x", window_s=0).count == 4  # 0 = everything kept
    clock.advance(60.0)
    assert windows.stats("x", window_s=30.0) == WindowStats()


def test_labels_select_every_series_that_has_them() -> None:
    windows, _ = make()
    windows.ingest(
        observations_of(
            [
                sample("lat", 1.0, model="a", code="ok"),
                sample("lat", 2.0, model="a", code="expired"),
                sample("lat", 3.0, model="b", code="ok"),
                sample("lat", 4.0, service="scheduler", model="a", code="ok"),
                sample("other", 5.0, model="a"),
            ]
        )
    )

    def count(**labels: str) -> int:
        return windows.stats("lat", label_set(labels)).count

    assert count() == 4
    assert count(model="a") == 3
    assert count(model="a", code="ok") == 2
    assert count(service="gateway", model="a") == 2
    assert count(model="c") == 0
    assert count(model="a", extra="x") == 0
    assert windows.stats("lat", label_set({"code": "ok"})).sum == 8.0
    assert windows.stats("missing") == WindowStats()


def test_ring_overwrites_oldest() -> None:
    windows, _ = make(ring_size=100)
    windows.ingest(observations_of([sample("x", float(v)) for v in range(250)]))

    stats = windows.stats("x")

    assert stats.count == 100
    assert (stats.min, stats.max) == (150.0, 249.0)
    assert stats.sum == sum(range(150, 250))


def test_series_grows_then_wraps() -> None:
    series = Series("x", frozenset(), capacity=300)
    for v in range(1000):
        series.extend(float(v), [float(v)], v)
        if v in (10, 64, 65, 200, 299, 300, 301, 999):
            held = sorted(series.values_since(None).tolist())
            assert held == [float(x) for x in range(max(0, v - 299), v + 1)]
    assert len(series) == 300
    assert sorted(series.values_since(900.0).tolist()) == [float(x) for x in range(900, 1000)]
    assert series.latest() == Sample("x", 999.0, frozenset(), 999)
    assert series.total == 1000


def test_latest_per_matching_series() -> None:
    windows, _ = make()
    windows.ingest(
        observations_of(
            [sample("queue_depth", 3.0, 111, model="a"), sample("queue_depth", 7.0, 112, model="b")]
        )
    )
    windows.ingest(
        observations_of([sample("queue_depth", 4.0, 113, model="a"), sample("active_clients", 2.0, 114)])
    )

    latest = windows.latest("queue_depth")
    assert [(s.value, dict(s.labels)["model"], s.timestamp_unix_ns) for s in latest] == [
        (4.0, "a", 113),
        (7.0, "b", 112),
    ]
    assert [s.value for s in windows.latest("queue_depth", label_set({"model": "b"}))] == [7.0]
    assert [s.name for s in windows.latest()] == ["active_clients", "queue_depth", "queue_depth"]
    assert windows.latest("nothing") == []


def test_missing_timestamp_takes_the_clock() -> None:
    windows, clock = make()
    windows.ingest(observations_of([sample("x", 1.0)]))
    assert windows.latest("x")[0].timestamp_unix_ns == int(clock.time() * 1e9)


def test_series_limit_refuses_new_series_only() -> None:
    windows, _ = make(max_series=2)
    kept = windows.ingest(
        observations_of([sample("x", 1.0, k="1"), sample("x", 1.0, k="2"), sample("x", 1.0, k="3")])
    )
    kept += windows.ingest(observations_of([sample("x", 2.0, k="1"), sample("y", 1.0)]))

    assert len(kept) == 3
    assert windows.series_count == 2
    assert windows.refused == 2
    assert windows.names() == ["x"]


def test_negative_window_is_refused() -> None:
    windows, _ = make()
    with pytest.raises(ValueError):
        windows.stats("x", window_s=-1.0)


@pytest.mark.parametrize("chunk", [1, 7, 64, 299, 300, 301, 1000])
def test_extending_in_chunks_keeps_what_one_at_a_time_keeps(chunk: int) -> None:
    """Whatever the batching, a series holds the same values at the same places, with the
    same running count and sum (to the bit), and the same receive times per value."""
    values = np.random.default_rng(3).lognormal(size=1000).tolist()
    one_by_one = Series("x", frozenset(), capacity=300)
    chunked = Series("x", frozenset(), capacity=300)
    for index, value in enumerate(values):
        one_by_one.extend(float(index // chunk), [value], index)
    for start in range(0, len(values), chunk):
        end = min(start + chunk, len(values))
        chunked.extend(float(start // chunk), values[start:end], end - 1)
        assert len(chunked) == min(300, end)

    for cutoff in (None, 0.0, 3.0, 500.0 / chunk):
        assert np.array_equal(chunked.window_since(cutoff)[0], one_by_one.window_since(cutoff)[0])
        assert np.array_equal(chunked.window_since(cutoff)[1], one_by_one.window_since(cutoff)[1])
    assert (chunked.total, chunked.value_total) == (one_by_one.total, one_by_one.value_total)
    assert chunked.latest() == one_by_one.latest() == Sample("x", values[-1], frozenset(), 999)


def test_observations_group_samples_per_series_in_order() -> None:
    grouped = observations_of(
        [sample("x", 1.0, 10, k="a"), sample("y", 2.0, 11), sample("x", 3.0, 12, k="a"), sample("x", 4.0, 13)]
    )

    assert [(o.name, dict(o.labels).get("k"), o.values, o.timestamps_unix_ns) for o in grouped] == [
        ("x", "a", [1.0, 3.0], [10, 12]),
        ("y", None, [2.0], [11]),
        ("x", None, [4.0], [13]),
    ]
    assert grouped[0].samples() == [sample("x", 1.0, 10, k="a"), sample("x", 3.0, 12, k="a")]
