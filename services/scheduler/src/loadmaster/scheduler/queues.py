"""The waiting rooms: one ordered queue per model, plus one deadline index across them.

Pure data structures (no streams, no clock): the core asks, the queues answer.
Each model has two heaps over the same requests, one in strategy order (who is
served next) and one in arrival order (who is dropped under `drop_oldest`), and
one heap across all models orders deadlines (what expires next). Removal is lazy:
a heap entry carries the token of the push that made it, and is valid only while
`_live` maps its key to that token. Heaps are compacted when stale entries outnumber
live ones, so memory stays proportional to the number of waiting requests.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from loadmaster.scheduler.domain import Request, RequestKey
from loadmaster.scheduler.strategies.base import Ordering, SortKey

__all__ = ["RequestQueues"]

_SLACK = 64  # stale entries tolerated before a heap is compacted


@dataclass(slots=True)
class _ModelHeaps:
    order: list[tuple[SortKey, int, RequestKey]] = field(default_factory=list)
    arrival: list[tuple[int, int, RequestKey]] = field(default_factory=list)
    count: int = 0


@dataclass(frozen=True, slots=True)
class _Live:
    token: int
    request: Request


class RequestQueues:
    """Every waiting request, by model, in the order of one `Ordering`."""

    def __init__(self, ordering: Ordering) -> None:
        self._ordering = ordering
        self._models: dict[str, _ModelHeaps] = {}
        self._live: dict[RequestKey, _Live] = {}
        self._deadlines: list[tuple[float, int, RequestKey]] = []
        self._tokens = itertools.count()

    @property
    def ordering(self) -> Ordering:
        return self._ordering

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: RequestKey) -> bool:
        return key in self._live

    def depth(self, model_id: str) -> int:
        heaps = self._models.get(model_id)
        return heaps.count if heaps is not None else 0

    def waiting_models(self) -> list[str]:
        """Models with at least one waiting request."""
        return list(self._models)

    def push(self, request: Request) -> None:
        if request.key in self._live:
            raise ValueError(f"request {request.key} is already queued")
        token = next(self._tokens)
        self._live[request.key] = _Live(token, request)
        heaps = self._models.get(request.model_id)
        if heaps is None:
            heaps = self._models[request.model_id] = _ModelHeaps()
        heapq.heappush(heaps.order, (self._ordering.key(request), token, request.key))
        heapq.heappush(heaps.arrival, (request.arrival, token, request.key))
        heaps.count += 1
        heapq.heappush(self._deadlines, (request.deadline, token, request.key))

    def peek(self, model_id: str) -> Request | None:
        """The request the strategy serves next for `model_id`, left in place."""
        entry = self.peek_entry(model_id)
        return entry[1] if entry is not None else None

    def peek_entry(self, model_id: str) -> tuple[SortKey, Request] | None:
        """(sort key, request) of the request served next for `model_id`, left in place."""
        heaps = self._models.get(model_id)
        if heaps is None:
            return None
        order = heaps.order
        while order and not self._valid(order[0][1], order[0][2]):
            heapq.heappop(order)
        return (order[0][0], self._live[order[0][2]].request) if order else None

    def peek_oldest(self, model_id: str) -> Request | None:
        """The earliest-arrived request waiting for `model_id`, left in place."""
        heaps = self._models.get(model_id)
        if heaps is None:
            return None
        arrival = heaps.arrival
        while arrival and not self._valid(arrival[0][1], arrival[0][2]):
            heapq.heappop(arrival)
        return self._live[arrival[0][2]].request if arrival else None

    def pop(self, model_id: str) -> Request | None:
        """Remove and return the request the strategy serves next for `model_id`."""
        head = self.peek(model_id)
        if head is not None:
            self.remove(head.key)
        return head

    def pop_oldest(self, model_id: str) -> Request | None:
        """Remove and return the earliest-arrived request waiting for `model_id`."""
        oldest = self.peek_oldest(model_id)
        return self.remove(oldest.key) if oldest is not None else None

    def get(self, key: RequestKey) -> Request | None:
        live = self._live.get(key)
        return live.request if live is not None else None

    def reordered(self, ordering: Ordering) -> RequestQueues:
        """The same waiting requests in a new queue under `ordering` (keys recomputed in
        arrival order, so stateful orderings see them as they came)."""
        queues = RequestQueues(ordering)
        for request in sorted(self.requests(), key=lambda r: r.arrival):
            queues.push(request)
        return queues

    def remove(self, key: RequestKey) -> Request | None:
        """Take `key` out of its queue; None if it was not waiting."""
        live = self._live.pop(key, None)
        if live is None:
            return None
        model_id = live.request.model_id
        heaps = self._models[model_id]
        heaps.count -= 1
        if heaps.count == 0:
            del self._models[model_id]  # drops its stale entries with it
        else:
            token = live.token
            # the usual removals take a heap's head (a grant, drop_oldest): pop it now
            if heaps.order[0][1] == token:
                heapq.heappop(heaps.order)
            if heaps.arrival[0][1] == token:
                heapq.heappop(heaps.arrival)
            if max(len(heaps.order), len(heaps.arrival)) > 2 * heaps.count + _SLACK:
                self._compact(heaps)
        if len(self._deadlines) > 2 * len(self._live) + _SLACK:
            self._deadlines = [e for e in self._deadlines if self._valid(e[1], e[2])]
            heapq.heapify(self._deadlines)
        return live.request

    def next_deadline(self) -> float | None:
        """The earliest deadline among waiting requests."""
        deadlines = self._deadlines
        while deadlines and not self._valid(deadlines[0][1], deadlines[0][2]):
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else None

    def pop_expired(self, now: float) -> list[Request]:
        """Remove and return every waiting request whose deadline is at or before `now`."""
        expired: list[Request] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, token, key = heapq.heappop(self._deadlines)
            if self._valid(token, key):
                request = self.remove(key)
                if request is not None:
                    expired.append(request)
        return expired

    def requests(self) -> list[Request]:
        """Every waiting request (any order)."""
        return [live.request for live in self._live.values()]

    def _valid(self, token: int, key: RequestKey) -> bool:
        live = self._live.get(key)
        return live is not None and live.token == token

    def _compact(self, heaps: _ModelHeaps) -> None:
        heaps.order = [e for e in heaps.order if self._valid(e[1], e[2])]
        heapq.heapify(heaps.order)
        heaps.arrival = [e for e in heaps.arrival if self._valid(e[1], e[2])]
        heapq.heapify(heaps.arrival)
