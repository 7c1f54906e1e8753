"""Fan-out of new samples to watchers (`MetricsService.Watch`).

Samples arrive per series (`Observations`); a series' samples become `Sample` values
only when some watcher wants them, once for all such watchers. Each watcher gets a
bounded buffer. Publishing never waits: when a watcher reads more slowly than samples
arrive, its oldest pending samples are dropped (and counted), so one slow watcher
neither grows memory nor slows ingest.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from contextlib import contextmanager

from loadmaster.metrics.windows import LabelSet, Observations, Sample, matches_labels

__all__ = ["Subscription", "Subscriptions"]


class Subscription:
    """One watcher: the samples it asked for, waiting to be read. Iterate it for batches."""

    def __init__(self, *, names: frozenset[str], labels: LabelSet, max_pending: int) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self.names = names
        self.labels = labels
        self._max_pending = max_pending
        self._pending: collections.deque[Sample] = collections.deque(maxlen=max_pending)
        self._ready = asyncio.Event()
        self._closed = False
        self.dropped = 0

    def matches(self, name: str, labels: LabelSet) -> bool:
        return (not self.names or name in self.names) and matches_labels(labels, self.labels)

    @property
    def closed(self) -> bool:
        return self._closed

    def offer(self, samples: Sequence[Sample]) -> int:
        """Queue `samples` (the caller matched them), dropping the oldest pending ones when
        full; returns how many were dropped."""
        if self._closed:
            return 0
        pending = self._pending
        dropped = max(0, len(pending) + len(samples) - self._max_pending)
        pending.extend(samples)
        if pending:
            self._ready.set()
        self.dropped += dropped
        return dropped

    def close(self) -> None:
        """End the iteration once what is pending has been read."""
        self._closed = True
        self._ready.set()

    async def batches(self) -> AsyncIterator[list[Sample]]:
        """Pending samples in arrival order, a batch at a time, until closed."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            if self._pending:
                batch = list(self._pending)
                self._pending.clear()
                yield batch
            if self._closed and not self._pending:
                return

    def __aiter__(self) -> AsyncIterator[list[Sample]]:
        return self.batches()


class Subscriptions:
    """The live watchers."""

    def __init__(self, *, max_pending: int = 4096) -> None:
        self._max_pending = max_pending
        self._subscriptions: set[Subscription] = set()
        self._closed = False
        self.dropped = 0  # over every watcher, ever

    def __len__(self) -> int:
        return len(self._subscriptions)

    @contextmanager
    def watch(self, *, names: Iterable[str] = (), labels: LabelSet = frozenset()) -> Iterator[Subscription]:
        """A subscription for the duration of the `with` block."""
        subscription = Subscription(names=frozenset(names), labels=labels, max_pending=self._max_pending)
        if self._closed:
            subscription.close()
        self._subscriptions.add(subscription)
        try:
            yield subscription
        finally:
            self._subscriptions.discard(subscription)
            subscription.close()

    def publish(self, observations: Iterable[Observations]) -> None:
        if not self._subscriptions:
            return
        for observed in observations:
            samples: list[Sample] | None = None
            for subscription in self._subscriptions:
                if subscription.matches(observed.name, observed.labels):
                    if samples is None:
                        samples = observed.samples()
                    self.dropped += subscription.offer(samples)

    def close_all(self) -> None:
        """End every watch, and any started later (server shutdown)."""
        self._closed = True
        for subscription in self._subscriptions:
            subscription.close()
