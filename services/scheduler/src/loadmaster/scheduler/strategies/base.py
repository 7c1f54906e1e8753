"""The ordering interface every strategy implements."""

from __future__ import annotations

from typing import Protocol

from loadmaster.scheduler.domain import Request

__all__ = ["Ordering", "SortKey"]

# Compared element by element; smaller is served first. Strategies end their key with
# `request.arrival` so ties resolve first come, first served.
SortKey = tuple[float, ...]


class Ordering(Protocol):
    """Ranks the requests waiting for one model.

    `key` is computed once, when a request enters a queue (and again when a retried
    request re-enters it), so it must depend only on the request and the strategy's
    own state at that moment.
    """

    @property
    def name(self) -> str: ...

    def key(self, request: Request) -> SortKey: ...
