"""Fan-out of new samples to watchers (`Metrics.Watch`).

Each watcher gets a bounded buffer. Publishing never waits: when a watcher reads
more slowly than samples arrive, its oldest pending samples are dropped (and
counted), so one slow watcher neither grows memory nor slows ingest.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from contextlib import contextmanager

from loadmaster.metrics.windows import LabelSet, Sample, matches_labels

__all__ = ["Subscription", "Subscriptions"]


class Subscription:
    """One watcher: the samples it asked for, waiting to be read. Iterate it for batches."""

    def __init__(self, *, names: frozenset[str], labels: LabelSet, max_pending: int) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self.names = names
        self.labels = labels
        self._pending: collections.deque[Sample] = collections.deque(maxlen=max_pending)
        self._ready = asyncio.Event()
        self._closed = False
        self.dropped = 0

    def matches(self, sample: Sample) -> bool:
        return (not self.names or sample.name in self.names) and matches_labels(sample.labels, self.labels)

    @property
    def closed(self) -> bool:
        return self._closed

    def offer(self, samples: Iterable[Sample]) -> int:
        """Queue the matching samples, dropping the oldest pending ones when full; returns
        how many were dropped."""
        if self._closed:
            return 0
        pending = self._pending
        limit = pending.maxlen
        dropped = 0
        for sample in samples:
            if self.matches(sample):
                if len(pending) == limit:
                    dropped += 1
                pending.append(sample)
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

    def publish(self, samples: Sequence[Sample]) -> None:
        if not samples:
            return
        for subscription in self._subscriptions:
            self.dropped += subscription.offer(samples)

    def close_all(self) -> None:
        """End every watch, and any started later (server shutdown)."""
        self._closed = True
        for subscription in self._subscriptions:
            subscription.close()
