"""Prometheus exposition of the reported series.

Every name declared in `loadmaster.common.metric_names.METRICS` is exposed per
reporting service as `loadmaster_<service>_<name>`, fed as samples arrive:

- histogram: a `Histogram`; `_ms` names become `_seconds` (value / 1000), `_bytes`
  names stay bytes, other names (e.g. `batch_size`) are plain counts;
- counter: a `Counter` (`..._total`), each sample's value is the increment;
- gauge: a `Gauge` set to the latest value.

Samples arrive per series (`Observations`), and a histogram takes a series' values in
one step: each touched bucket incremented once, the sum added in order (so it equals
one `observe` per value to the last bit).

Only the labels the spec declares become Prometheus labels (a missing one is ""),
so cardinality stays bounded whatever else reporters attach. Names not in
`METRICS` stay in the windows (GetStats, GetLatest, Watch) but are not exposed;
each is logged once.
"""

from __future__ import annotations

import bisect
import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import choose_encoder

from loadmaster.common.metric_names import METRICS, MetricKind, MetricSpec
from loadmaster.metrics.windows import LabelSet, Observations, SeriesKey

__all__ = [
    "COUNT_BUCKETS",
    "LATENCY_BUCKETS_S",
    "SIZE_BUCKETS_BYTES",
    "Exposed",
    "Exposition",
    "ServiceMetrics",
    "exposed",
]

log = logging.getLogger(__name__)

# 100 µs (a hop on one host) to 2 min (a cold model load).
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
# 256 B to 1 GiB, x4 per bucket.
SIZE_BUCKETS_BYTES: tuple[float, ...] = tuple(float(1 << shift) for shift in range(8, 31, 2))
# Counts such as batch sizes: 1 to 1024, x2 per bucket.
COUNT_BUCKETS: tuple[float, ...] = tuple(float(1 << shift) for shift in range(11))

_NOT_NAME_CHARS = re.compile(r"[^a-zA-Z0-9_]")


@dataclass(frozen=True, slots=True)
class Exposed:
    """How one reported name of one service appears in Prometheus. `family` is the metric
    family name (counters' samples carry `_total` after it); `scale` multiplies values."""

    family: str
    kind: MetricKind
    help: str
    labels: tuple[str, ...]
    scale: float = 1.0
    buckets: tuple[float, ...] = ()


def _service_part(service: str) -> str:
    return _NOT_NAME_CHARS.sub("_", service) or "unknown"


def exposed(service: str, spec: MetricSpec) -> Exposed:
    """The Prometheus form of `spec` reported by `service` (`model-pool` -> `model_pool`)."""
    base = f"loadmaster_{_service_part(service)}_{spec.name}"
    if spec.kind is MetricKind.HISTOGRAM:
        if spec.name.endswith("_ms"):
            return Exposed(
                base.removesuffix("_ms") + "_seconds",
                spec.kind,
                spec.help,
                spec.labels,
                scale=0.001,
                buckets=LATENCY_BUCKETS_S,
            )
        if spec.name.endswith("_bytes"):
            return Exposed(base, spec.kind, spec.help, spec.labels, buckets=SIZE_BUCKETS_BYTES)
        return Exposed(base, spec.kind, spec.help, spec.labels, buckets=COUNT_BUCKETS)
    if spec.kind is MetricKind.COUNTER:
        return Exposed(base.removesuffix("_total"), spec.kind, spec.help, spec.labels)
    return Exposed(base, spec.kind, spec.help, spec.labels)


_Values = Sequence[float]
_Sink = Callable[[_Values], None]


def _histogram_sink(histogram: Histogram, scale: float) -> _Sink:
    """Observe a series' values (times `scale`) as one `observe` call per value would, but
    touching each bucket and the sum once per batch: `observe` takes two locks per value.
    Reaches into the child's `_upper_bounds`, `_buckets` and `_sum`; tests compare the
    result with `observe`, so a prometheus_client change that breaks this shows."""
    bounds = list(histogram._upper_bounds)
    buckets = histogram._buckets
    total = histogram._sum

    def observe(values: _Values) -> None:
        counts: dict[int, int] = {}
        running = total.get()
        for value in values:
            value *= scale
            running += value
            index = bisect.bisect_left(bounds, value)  # the first bucket with value <= bound
            counts[index] = counts.get(index, 0) + 1
        for index, count in counts.items():
            buckets[index].inc(count)
        total.set(running)

    return observe


class Exposition:
    """A registry fed with samples, rendered for `GET /metrics`."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        specs: Mapping[str, MetricSpec] = METRICS,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._specs = specs
        self._families: dict[tuple[str, str], Histogram | Counter | Gauge | None] = {}
        self._sinks: dict[SeriesKey, _Sink | None] = {}
        self._warned: set[str] = set()

    def observe(self, observations: Iterable[Observations]) -> None:
        """Feed series' values (labels include `service`) into their Prometheus series."""
        sinks = self._sinks
        for observed in observations:
            key = (observed.name, observed.labels)
            try:
                sink = sinks[key]
            except KeyError:
                sink = sinks[key] = self._sink_for(*key)
            if sink is not None:
                sink(observed.values)

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition body and its content type (OpenMetrics when `accept` asks for it)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type

    def _sink_for(self, name: str, label_set: LabelSet) -> _Sink | None:
        spec = self._specs.get(name)
        if spec is None:
            self._warn_once(name, "not in METRICS; kept for queries, not exposed to Prometheus")
            return None
        labels = dict(label_set)
        service = labels.get("service", "")
        family = self._family(service, spec)
        if family is None:
            return None
        if spec.labels:
            family = family.labels(*(labels.get(name, "") for name in spec.labels))
        if isinstance(family, Histogram):
            return _histogram_sink(family, exposed(service, spec).scale)
        if isinstance(family, Counter):
            inc = family.inc

            def add(values: _Values) -> None:
                for value in values:
                    if value >= 0:
                        inc(value)
                    else:
                        self._warn_once(name, "negative counter increment ignored")

            return add
        gauge = family

        def set_latest(values: _Values) -> None:
            gauge.set(values[-1])

        return set_latest

    def _family(self, service: str, spec: MetricSpec) -> Histogram | Counter | Gauge | None:
        key = (service, spec.name)
        if key in self._families:
            return self._families[key]
        form = exposed(service, spec)
        family: Histogram | Counter | Gauge | None
        try:
            if form.kind is MetricKind.HISTOGRAM:
                family = Histogram(
                    form.family, form.help, form.labels, registry=self.registry, buckets=form.buckets
                )
            elif form.kind is MetricKind.COUNTER:
                family = Counter(form.family, form.help, form.labels, registry=self.registry)
            else:
                family = Gauge(form.family, form.help, form.labels, registry=self.registry)
        except ValueError as error:  # a clashing or invalid name
            self._warn_once(f"{service}/{spec.name}", f"cannot be exposed: {error}")
            family = None
        self._families[key] = family
        return family

    def _warn_once(self, name: str, message: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            log.warning("metric %s: %s", name, message)


class ServiceMetrics:
    """The metrics service's own series, in the same registry."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        series: Callable[[], float],
        watchers: Callable[[], float],
        process: bool = True,
    ) -> None:
        self.samples_accepted = Counter(
            "loadmaster_metrics_samples_accepted",
            "Samples kept, by reporting service",
            ("service",),
            registry=registry,
        )
        self.samples_refused = Counter(
            "loadmaster_metrics_samples_refused",
            "Samples refused: invalid (no name, non-finite value) or series_limit",
            ("reason",),
            registry=registry,
        )
        self.watch_dropped = Counter(
            "loadmaster_metrics_watch_dropped",
            "Samples dropped for watchers that read too slowly",
            registry=registry,
        )
        self.ingest_seconds = Histogram(
            "loadmaster_metrics_ingest_seconds",
            "Time to ingest one reported batch",
            registry=registry,
            buckets=LATENCY_BUCKETS_S,
        )
        Gauge("loadmaster_metrics_series", "Series kept", registry=registry).set_function(series)
        Gauge("loadmaster_metrics_watchers", "Open Watch streams", registry=registry).set_function(watchers)
        if process:
            ProcessCollector(registry=registry)
