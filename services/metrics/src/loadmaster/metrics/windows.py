"""Sample windows: a ring buffer per series, stats and latest values over them.

A series is one metric name with one label set; the label set includes `service`,
the service that reported it. Each series keeps its last `ring_size` samples in
two preallocated numpy arrays (receive time, value), so memory per series is fixed.
Samples arrive as `Observations`: the values of one series in a report batch, so ingest
is a few slice stores per series rather than a `Sample` and two stores per sample.
Arrays start small and double up to `ring_size`, so the many series that only ever
see a handful of samples (gauges, rare error codes) do not each hold a full ring.

Windows are measured on the injected clock's monotonic time at which a sample was
ingested (reporters flush every few hundred ms), not on the reporter's wall clock,
so a reporter with a skewed clock cannot push its samples out of, or into, a window.
The reporter's timestamp is kept for the latest sample of each series.

Stats aggregate every series of a name whose labels include the requested labels,
over the samples still in the rings. Pure code: no I/O, time comes from a `Clock`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from loadmaster.common.clock import Clock

__all__ = [
    "LabelSet",
    "Observations",
    "Sample",
    "Series",
    "SeriesKey",
    "WindowStats",
    "Windows",
    "label_set",
    "matches_labels",
    "observations_of",
]

log = logging.getLogger(__name__)

LabelSet = frozenset[tuple[str, str]]
SeriesKey = tuple[str, LabelSet]

_INITIAL_CAPACITY = 64
_PERCENTILES = (50.0, 95.0, 99.0)
_NO_SERIES: Mapping[LabelSet, Series] = {}


def label_set(labels: Mapping[str, str], **extra: str) -> LabelSet:
    """The frozen label set of `labels` with `extra` added (an `extra` key wins)."""
    if extra:
        return frozenset({**labels, **extra}.items())
    return frozenset(labels.items())


def matches_labels(series_labels: LabelSet, wanted: LabelSet) -> bool:
    """A series matches when it carries every wanted label with the same value."""
    return wanted <= series_labels


@dataclass(frozen=True, slots=True)
class Sample:
    """One observation of a series; `labels` include `service`."""

    name: str
    value: float
    labels: LabelSet
    timestamp_unix_ns: int = 0

    @property
    def key(self) -> SeriesKey:
        return (self.name, self.labels)


@dataclass(frozen=True, slots=True)
class Observations:
    """Samples of one series reported together, oldest first: `values[i]` was observed at
    `timestamps_unix_ns[i]` (reporter wall clock; <= 0 unknown). `labels` include `service`.
    Plain lists, not numpy arrays: at a few values per series, numpy's per-call cost would
    be most of the ingest, and the rings take lists in one slice store each."""

    name: str
    labels: LabelSet
    values: list[float]
    timestamps_unix_ns: list[int]

    def __len__(self) -> int:
        return len(self.values)

    def samples(self) -> list[Sample]:
        """One `Sample` per value, for consumers that take them one at a time (watchers)."""
        name, labels = self.name, self.labels
        return [
            Sample(name, value, labels, timestamp)
            for value, timestamp in zip(self.values, self.timestamps_unix_ns, strict=True)
        ]


def observations_of(samples: Iterable[Sample]) -> list[Observations]:
    """`samples` grouped per series, in the order each series first appears; each series'
    samples keep their order."""
    grouped: dict[SeriesKey, tuple[list[float], list[int]]] = {}
    for sample in samples:
        values, timestamps = grouped.setdefault(sample.key, ([], []))
        values.append(sample.value)
        timestamps.append(sample.timestamp_unix_ns)
    return [
        Observations(name, labels, values, timestamps)
        for (name, labels), (values, timestamps) in grouped.items()
    ]


@dataclass(frozen=True, slots=True)
class WindowStats:
    count: int = 0
    mean: float = 0.0
    min: float = 0.0
    p50: float = 0.0
    p95: float = 0.0
    p99: float = 0.0
    max: float = 0.0
    sum: float = 0.0

    @classmethod
    def of(cls, values: npt.NDArray[np.float64]) -> WindowStats:
        """Stats of `values` (any order); zeros when empty. Percentiles interpolate linearly."""
        count = int(values.size)
        if count == 0:
            return cls()
        total = float(values.sum())
        p50, p95, p99 = (float(p) for p in np.percentile(values, _PERCENTILES))
        return cls(
            count=count,
            mean=total / count,
            min=float(values.min()),
            p50=p50,
            p95=p95,
            p99=p99,
            max=float(values.max()),
            sum=total,
        )


class Series:
    """The last `capacity` samples of one series, oldest overwritten first: the n-th sample
    ever appended lives at index n % capacity of the arrays."""

    __slots__ = (
        "_received",
        "_size",
        "_values",
        "capacity",
        "labels",
        "last_timestamp_unix_ns",
        "last_value",
        "name",
        "total",
        "value_total",
    )

    def __init__(self, name: str, labels: LabelSet, *, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.name = name
        self.labels = labels
        self.capacity = capacity
        initial = min(capacity, _INITIAL_CAPACITY)
        self._received = np.empty(initial, dtype=np.float64)
        self._values = np.empty(initial, dtype=np.float64)
        self._size = 0  # samples held
        self.total = 0  # samples ever appended
        self.value_total = 0.0  # sum of the values ever appended
        self.last_value = 0.0
        self.last_timestamp_unix_ns = 0

    def __len__(self) -> int:
        return self._size

    def extend(self, received: float, values: Sequence[float], last_timestamp_unix_ns: int) -> None:
        """Append `values` (oldest first), all received at `received`; the last of them was
        observed at `last_timestamp_unix_ns`."""
        count = len(values)
        if count == 0:
            return
        capacity = self.capacity
        first = self.total  # the all-time index of the first new value
        self.total += count
        # Summed in order, one addition per value, so window_s=0 totals do not depend on
        # how samples were batched (numpy's sum() adds pairwise).
        total = self.value_total
        for value in values:
            total += value
        self.value_total = total
        self.last_value = float(values[-1])
        self.last_timestamp_unix_ns = last_timestamp_unix_ns
        if count > capacity:  # only the newest `capacity` stay
            first += count - capacity
            values = values[count - capacity :]
            count = capacity
        if first + count > self._values.shape[0] and self._values.shape[0] < capacity:
            self._grow(first + count)
        start = first % capacity
        head = min(count, capacity - start)
        self._received[start : start + head] = received
        self._values[start : start + head] = values[:head]
        if head < count:  # wrapped around
            self._received[: count - head] = received
            self._values[: count - head] = values[head:]
        self._size = min(capacity, self._size + count)

    def _grow(self, needed: int) -> None:
        # Only before the first wrap: the arrays are then filled from index 0 in order.
        size = self._values.shape[0]
        while size < needed and size < self.capacity:
            size = min(self.capacity, 2 * size)
        received = np.empty(size, dtype=np.float64)
        values = np.empty(size, dtype=np.float64)
        held = self._size
        received[:held] = self._received[:held]
        values[:held] = self._values[:held]
        self._received, self._values = received, values

    def values_since(self, cutoff: float | None) -> npt.NDArray[np.float64]:
        """Values received at or after `cutoff` (all when None), in no particular order."""
        values = self._values[: self._size]
        if cutoff is None:
            return values
        return values[self._received[: self._size] >= cutoff]

    def window_since(self, cutoff: float | None) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """(receive times, values) of the samples received at or after `cutoff` (all when
        None), in no particular order."""
        received = self._received[: self._size]
        values = self._values[: self._size]
        if cutoff is None:
            return received, values
        keep = received >= cutoff
        return received[keep], values[keep]

    def latest(self) -> Sample:
        return Sample(self.name, self.last_value, self.labels, self.last_timestamp_unix_ns)


class Windows:
    """Every series kept, indexed by name. At most `max_series` series: samples of
    further new series are refused (a label with unbounded values is a reporter bug)."""

    def __init__(self, *, ring_size: int, clock: Clock, max_series: int = 10_000) -> None:
        if ring_size < 1:
            raise ValueError("ring_size must be >= 1")
        self.ring_size = ring_size
        self.max_series = max_series
        self._clock = clock
        self._by_name: dict[str, dict[LabelSet, Series]] = {}
        self._series_count = 0
        self.refused = 0  # samples refused because the series limit was reached
        self._warned_full = False

    @property
    def series_count(self) -> int:
        return self._series_count

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def series(self, name: str | None = None) -> Iterator[Series]:
        """Every series of `name` (of every name when None)."""
        if name is not None:
            yield from self._by_name.get(name, {}).values()
            return
        for by_labels in self._by_name.values():
            yield from by_labels.values()

    def ingest(self, observations: Iterable[Observations]) -> list[Observations]:
        """Append `observations`, all received now; returns those kept (refused ones are counted)."""
        received = self._clock.monotonic()
        wall_ns = 0
        kept: list[Observations] = []
        by_name = self._by_name
        for observed in observations:
            if not len(observed):
                continue
            series = by_name.get(observed.name, _NO_SERIES).get(observed.labels)
            if series is None:
                series = self._new_series(observed)
                if series is None:
                    continue
            timestamp = observed.timestamps_unix_ns[-1]
            if timestamp <= 0:
                if wall_ns == 0:
                    wall_ns = int(self._clock.time() * 1e9)
                timestamp = wall_ns
            series.extend(received, observed.values, timestamp)
            kept.append(observed)
        return kept

    def _new_series(self, observed: Observations) -> Series | None:
        if self._series_count >= self.max_series:
            self.refused += len(observed)
            if not self._warned_full:
                self._warned_full = True
                log.warning(
                    "series limit %d reached; refusing samples of new series (first: %s %s)",
                    self.max_series,
                    observed.name,
                    dict(observed.labels),
                )
            return None
        series = Series(observed.name, observed.labels, capacity=self.ring_size)
        self._by_name.setdefault(observed.name, {})[observed.labels] = series
        self._series_count += 1
        return series

    def now(self) -> float:
        """The monotonic time windows are measured on."""
        return self._clock.monotonic()

    def cutoff(self, window_s: float) -> float | None:
        """The earliest receive time inside a window of `window_s` seconds (None: no limit)."""
        if window_s < 0 or math.isnan(window_s):
            raise ValueError("window_s must be >= 0")
        return None if window_s == 0 or math.isinf(window_s) else self._clock.monotonic() - window_s

    def stats(self, name: str, labels: LabelSet = frozenset(), *, window_s: float = 0.0) -> WindowStats:
        """Stats of `name` over the last `window_s` seconds (0 = everything kept), across every
        series whose labels include `labels`."""
        cutoff = self.cutoff(window_s)
        parts = [
            series.values_since(cutoff)
            for series in self.series(name)
            if matches_labels(series.labels, labels)
        ]
        if not parts:
            return WindowStats()
        values = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return WindowStats.of(values)

    def latest(self, name: str | None = None, labels: LabelSet = frozenset()) -> list[Sample]:
        """The newest sample of each series of `name` (of every name when None) whose labels
        include `labels`, ordered by name then labels."""
        found = [
            series.latest()
            for series in self.series(name)
            if len(series) and matches_labels(series.labels, labels)
        ]
        found.sort(key=lambda sample: (sample.name, sorted(sample.labels)))
        return found
