"""The metrics core: one ingest path feeding the windows, the Prometheus exposition
and the watchers, and the queries over them. The gRPC servicer and the HTTP app
only translate to and from it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from prometheus_client import CollectorRegistry

from loadmaster.common.clock import Clock
from loadmaster.common.errors import InvalidArgumentError
from loadmaster.metrics.exposition import Exposition, ServiceMetrics
from loadmaster.metrics.model_stats import ModelStatistics, model_ids, model_statistics
from loadmaster.metrics.subscriptions import Subscription, Subscriptions
from loadmaster.metrics.windows import Observations, Sample, Windows, WindowStats, label_set

__all__ = ["MetricsHub"]


class MetricsHub:
    def __init__(
        self,
        *,
        ring_size: int,
        clock: Clock,
        max_series: int = 10_000,
        max_pending_per_watcher: int = 4096,
        registry: CollectorRegistry | None = None,
        process_metrics: bool = True,
        replica_ttl_s: float = 300.0,
    ) -> None:
        self._clock = clock
        self.windows = Windows(ring_size=ring_size, clock=clock, max_series=max_series)
        self.subscriptions = Subscriptions(max_pending=max_pending_per_watcher)
        self.exposition = Exposition(registry, replica_ttl_s=replica_ttl_s, clock=clock.monotonic)
        self.own = ServiceMetrics(
            self.exposition.registry,
            series=lambda: self.windows.series_count,
            watchers=lambda: len(self.subscriptions),
            process=process_metrics,
        )
        self.closed = asyncio.Event()  # set when the service stops

    def ingest(self, observations: Sequence[Observations], *, service: str = "", instance: str = "") -> int:
        """Keep `observations` (reported together by `instance` of `service`); returns how many samples
        were accepted. Series without a name or with timestamps that do not pair up with
        their values are refused whole, non-finite values one by one, as are the samples of
        new series past the series limit."""
        started = self._clock.monotonic()
        valid, invalid = _valid(observations)
        refused_before = self.windows.refused
        kept = self.windows.ingest(valid)
        self.exposition.observe(kept, service=service, replica=instance)
        dropped_before = self.subscriptions.dropped
        self.subscriptions.publish(kept)

        own = self.own
        accepted = sum(len(observed) for observed in kept)
        if accepted:
            own.samples_accepted.labels(service).inc(accepted)
        if invalid:
            own.samples_refused.labels("invalid").inc(invalid)
        if self.windows.refused > refused_before:
            own.samples_refused.labels("series_limit").inc(self.windows.refused - refused_before)
        if self.subscriptions.dropped > dropped_before:
            own.watch_dropped.inc(self.subscriptions.dropped - dropped_before)
        own.ingest_seconds.observe(max(0.0, self._clock.monotonic() - started))
        return accepted

    def stats(self, name: str, labels: Mapping[str, str], *, window_s: float) -> WindowStats:
        if not name:
            raise InvalidArgumentError("name is required")
        if math.isnan(window_s) or window_s < 0:
            raise InvalidArgumentError(f"window_s must be >= 0 (0 = everything kept), got {window_s}")
        return self.windows.stats(name, label_set(labels), window_s=window_s)

    def latest(self, name: str, labels: Mapping[str, str]) -> list[Sample]:
        """The newest sample of each matching series; an empty `name` matches every name."""
        return self.windows.latest(name or None, label_set(labels))

    def model_statistics(self, model_id: str, *, window_s: float) -> list[ModelStatistics]:
        """Statistics of `model_id` (of every model that reported when empty), by model id.
        A named model nothing was reported for gets all zeros."""
        if math.isnan(window_s) or window_s < 0:
            raise InvalidArgumentError(f"window_s must be >= 0 (0 = since the start), got {window_s}")
        models = [model_id] if model_id else model_ids(self.windows)
        return [model_statistics(self.windows, model, window_s=window_s) for model in models]

    @contextmanager
    def watch(self, *, names: Iterable[str], labels: Mapping[str, str]) -> Iterator[Subscription]:
        """New matching samples for the duration of the `with` block; empty `names` = all."""
        with self.subscriptions.watch(names=names, labels=label_set(labels)) as subscription:
            yield subscription

    def close(self) -> None:
        """The service is stopping: end every watch and tell reporters to go away."""
        self.closed.set()
        self.subscriptions.close_all()


def _valid(observations: Iterable[Observations]) -> tuple[list[Observations], int]:
    """The valid part of `observations` and how many samples were left out."""
    valid: list[Observations] = []
    invalid = 0
    for observed in observations:
        count = len(observed)
        if not observed.name or len(observed.timestamps_unix_ns) != count:
            invalid += count
            continue
        if not all(map(math.isfinite, observed.values)):
            finite = [
                (value, timestamp)
                for value, timestamp in zip(observed.values, observed.timestamps_unix_ns, strict=True)
                if math.isfinite(value)
            ]
            observed = Observations(
                observed.name, observed.labels, [v for v, _ in finite], [t for _, t in finite]
            )
            invalid += count - len(observed)
        if len(observed):
            valid.append(observed)
    return valid, invalid
