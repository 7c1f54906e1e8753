"""The ordering interface every strategy implements."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from loadmaster.common.ordering.requests import Request

__all__ = ["BatchRule", "Ordering", "Scope", "SortKey"]

# Compared element by element; smaller is served first. Strategies end their key with
# `request.arrival` so ties resolve first come, first served. Every key of one ordering
# has the same length: the queues flatten keys into their heap entries.
SortKey = tuple[float, ...]


class Scope(StrEnum):
    """How far one strategy's order reaches.

    MODEL: each model's queue is served on its own. GLOBAL: one queue across models:
    when several models can be granted at once, grants go out in the one global key order.
    """

    MODEL = "model"
    GLOBAL = "global"


@dataclass(frozen=True, slots=True)
class BatchRule:
    """Hold a model's requests until `max_batch_size` wait or the first has waited `max_wait_s`,
    then release up to `max_batch_size` of them to one worker."""

    max_batch_size: int
    max_wait_s: float


class Ordering(Protocol):
    """Ranks waiting requests.

    `key` is computed when a request enters a queue (again when a retried request
    re-enters it, or when the strategy is switched), from the request and the strategy's
    own state at that moment. Time-aware strategies put an absolute time in the key
    (a virtual deadline): a request that waits then gains on newer ones without any
    key being revisited.
    """

    @property
    def name(self) -> str: ...

    @property
    def scope(self) -> Scope: ...

    @property
    def batch(self) -> BatchRule | None: ...

    def key(self, request: Request) -> SortKey: ...

    def granted(self, request: Request, key: SortKey) -> None:
        """`request` left its queue for a worker (round robin advances its rotation)."""

    def forget_client(self, client_id: str) -> None:
        """The client disconnected (its queued requests are gone): drop its per-client state."""
