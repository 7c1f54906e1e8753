"""Prometheus exposition of the reported series.

Every name declared in `loadmaster.common.metric_names.METRICS` is exposed per
reporting service as `loadmaster_<service>_<name>` (the names every service reports,
such as `build_info` and `process_*`, once as `loadmaster_<name>` with a `service` label),
fed as samples arrive, in base units:

- histogram: a `Histogram`; `_ms` names become `_seconds` (value / 1000), `_bytes`
  names stay bytes, other names (e.g. `batch_size`) are plain counts;
- counter: a `Counter` (`..._total`), each sample's value is the increment;
- gauge: a `Gauge` set to the latest value; `_mb` names become `_bytes`.

Replicas: every series carries the reporting process as its `replica` label (the
`ReportBatch.instance`: a gateway's or worker's id, a broker's host and pid), so two
workers' gauges never overwrite each other and two gateways' counters can be told apart.
The series of a replica that has reported nothing for `replica_ttl_s` are removed (every
reporter sends its process metrics every few seconds, so only a gone process goes quiet).
Counters exist at 0 from the moment a replica (or, for a `model` label, a model) is first
seen, for every label combination its spec declares `known`.

Samples arrive per series (`Observations`), and a histogram takes a series' values in
one step: each touched bucket incremented once, the sum added in order (so it equals
one `observe` per value to the last bit).

Only the labels the spec declares become Prometheus labels (a missing one is ""),
so cardinality stays bounded whatever else reporters attach; a label the spec caps
(`capped`: values a client chooses, such as a tenant) keeps its first values and
exposes the rest as `other`. Names not in
`METRICS` stay in the windows (GetStats, GetLatest, Watch) but are not exposed;
each is logged once.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

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
MB = 1 << 20
REPLICA_LABEL = "replica"


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
    """The Prometheus form of `spec` reported by `service` (`model-pool` -> `model_pool`):
    its family name, kind, labels (`replica` first, and `service` before it for the names
    every service reports) and the scale to base units."""
    if spec.service:
        base = f"loadmaster_{_service_part(service)}_{spec.name}"
        labels = (REPLICA_LABEL, *spec.labels)
    else:
        base = f"loadmaster_{spec.name}"
        labels = ("service", REPLICA_LABEL, *spec.labels)
    if spec.kind is MetricKind.HISTOGRAM:
        if spec.name.endswith("_ms"):
            return Exposed(
                base.removesuffix("_ms") + "_seconds",
                spec.kind,
                spec.help,
                labels,
                scale=0.001,
                buckets=LATENCY_BUCKETS_S,
            )
        if spec.name.endswith("_bytes"):
            return Exposed(base, spec.kind, spec.help, labels, buckets=SIZE_BUCKETS_BYTES)
        return Exposed(base, spec.kind, spec.help, labels, buckets=COUNT_BUCKETS)
    if spec.kind is MetricKind.COUNTER:
        return Exposed(base.removesuffix("_total"), spec.kind, spec.help, labels)
    if spec.name.endswith("_mb"):
        return Exposed(base.removesuffix("_mb") + "_bytes", spec.kind, spec.help, labels, scale=MB)
    return Exposed(base, spec.kind, spec.help, labels)


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


_Family = Histogram | Counter | Gauge
_Child = tuple[_Family, tuple[str, ...]]  # a family and one child's label values


@dataclass(slots=True)
class _Replica:
    """What one reporting process has put into the registry, to remove when it is gone."""

    last_seen: float
    children: set[_Child] = field(default_factory=set)
    models: set[str] = field(default_factory=set)


class Exposition:
    """A registry fed with samples, rendered for `GET /metrics`."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        specs: Mapping[str, MetricSpec] = METRICS,
        replica_ttl_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._specs = specs
        self._replica_ttl_s = replica_ttl_s
        self._clock = clock
        self._families: dict[tuple[str, str], _Family | None] = {}
        self._sinks: dict[tuple[SeriesKey, str], _Sink | None] = {}
        self._replicas: dict[tuple[str, str], _Replica] = {}
        self._next_sweep = 0.0
        self._warned: set[str] = set()
        self._capped: dict[tuple[str, str], set[str]] = {}  # (name, label) -> values exposed

    def observe(self, observations: Iterable[Observations], *, service: str = "", replica: str = "") -> None:
        """Feed series' values (labels include `service`) reported by one `replica` of
        `service` into their Prometheus series."""
        now = self._clock()
        self._touch(service, replica, now)
        sinks = self._sinks
        for observed in observations:
            key = ((observed.name, observed.labels), replica)
            try:
                sink = sinks[key]
            except KeyError:
                sink = sinks[key] = self._sink_for(observed.name, observed.labels, replica)
            if sink is not None:
                sink(observed.values)
        if now >= self._next_sweep:
            self.sweep(now)

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition body and its content type (OpenMetrics when `accept` asks for it)."""
        self.sweep(self._clock())
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type

    def sweep(self, now: float) -> None:
        """Remove every series of the replicas silent for `replica_ttl_s`."""
        self._next_sweep = now + 1.0
        gone = [key for key, seen in self._replicas.items() if now - seen.last_seen > self._replica_ttl_s]
        for service, replica in gone:
            for family, values in self._replicas.pop((service, replica)).children:
                try:
                    family.remove(*values)
                except KeyError:
                    pass
            for key in [
                key for key in self._sinks if key[1] == replica and dict(key[0][1]).get("service") == service
            ]:
                del self._sinks[key]
            log.info(
                "metrics of %s replica %s removed: nothing reported for %.0f s",
                service,
                replica,
                self._replica_ttl_s,
            )

    def _touch(self, service: str, replica: str, now: float) -> None:
        record = self._replicas.get((service, replica))
        if record is None:
            record = self._replicas[(service, replica)] = _Replica(now)
            self._zero_counters(service, replica, record, model=None)
        record.last_seen = now

    def _zero_counters(self, service: str, replica: str, record: _Replica, *, model: str | None) -> None:
        """Create at 0 the counters of `service` whose label values are all known: those
        without a `model` label when the replica is first seen, those with one for `model`."""
        for spec in self._specs.values():
            if spec.kind is not MetricKind.COUNTER or spec.service not in (service, ""):
                continue
            if ("model" in spec.labels) != (model is not None):
                continue
            choices: list[tuple[str, ...]] = []
            for label in spec.labels:
                known = (model,) if label == "model" and model is not None else spec.known_values(label)
                if known is None:
                    break
                choices.append(known)
            else:
                family = self._family(service, spec)
                if family is None:
                    continue
                head = (replica,) if spec.service else (service, replica)
                for combo in itertools.product(*choices):
                    values = (*head, *combo)
                    family.labels(*values)
                    record.children.add((family, values))

    def _sink_for(self, name: str, label_set: LabelSet, replica: str) -> _Sink | None:
        spec = self._specs.get(name)
        if spec is None:
            self._warn_once(name, "not in METRICS; kept for queries, not exposed to Prometheus")
            return None
        labels = dict(label_set)
        service = labels.get("service", "")
        family = self._family(service, spec)
        if family is None:
            return None
        record = self._replicas.get((service, replica))
        model = labels.get("model")
        if record is not None and model and model not in record.models:
            record.models.add(model)
            self._zero_counters(service, replica, record, model=model)
        head = (replica,) if spec.service else (service, replica)
        values = (*head, *(self._bounded(spec, label, labels.get(label, "")) for label in spec.labels))
        child = family.labels(*values)
        if record is not None:
            record.children.add((family, values))
        scale = exposed(service, spec).scale
        if isinstance(child, Histogram):
            return _histogram_sink(child, scale)
        if isinstance(child, Counter):
            inc = child.inc

            def add(values: _Values) -> None:
                for value in values:
                    if value >= 0:
                        inc(value)
                    else:
                        self._warn_once(name, "negative counter increment ignored")

            return add
        gauge = child

        def set_latest(values: _Values) -> None:
            gauge.set(values[-1] * scale)

        return set_latest

    def _bounded(self, spec: MetricSpec, label: str, value: str) -> str:
        """`value`, or `other` once a capped label has shown its bound of other values."""
        cap = spec.cap(label)
        if cap is None:
            return value
        seen = self._capped.setdefault((spec.name, label), set())
        if value in seen:
            return value
        if len(seen) >= cap:
            self._warn_once(f"{spec.name}.{label}", f"over {cap} values; the rest are exposed as 'other'")
            return "other"
        seen.add(value)
        return value

    def _family(self, service: str, spec: MetricSpec) -> _Family | None:
        key = (service if spec.service else "", spec.name)
        if key in self._families:
            return self._families[key]
        form = exposed(service, spec)
        family: _Family | None
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
