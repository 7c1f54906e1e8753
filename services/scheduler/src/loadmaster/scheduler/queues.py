"""The waiting rooms: one ordered queue per model, plus one deadline index across them.

Pure data structures (no streams, no clock): the core asks, the queues answer.
Each model has a heap in strategy order (who is served next) and an index in arrival
order (who is dropped under `drop_oldest`), and one index across all models orders
deadlines (what expires next). Removal is lazy: an entry carries the token of the push
that made it, and is valid only while that token is live (`_waiting`). Entries are
compacted away when stale ones outnumber live ones, so memory stays proportional to
the number of waiting requests.

This is the scheduler's hot path (a push, a peek and a removal per decision, with up
to 100k requests waiting), which shapes the entries:
- strategy order: flat tuples `(*sort key, token, sort key)`. A flat entry compares in
  one pass where a nested `(sort key, token)` compares the inner tuple twice (==,
  then <), which made heap pops at depth 100k twice as slow. The token never ties, so
  the copy of the sort key at the end (what `peek_entry` hands out) is never compared.
- arrival and deadline: `_TokenIndex`, mostly a deque of bare tokens, because both
  values almost always grow with each push. A tuple per push that outlives its
  request (a stale entry waits for compaction) kept the garbage collector's
  allocation count climbing at depth 100k: young collections every ~350 decisions
  and a full one (a walk over every queued request) every ~30k, about half the time
  of a decision. Ints are not tracked by the collector.
- requests are found through `_waiting[token]`; liveness is checked on the int token,
  not on the (session, request id) key, whose tuple hash is recomputed on every lookup.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from loadmaster.common.ordering.base import Ordering, SortKey
from loadmaster.scheduler.domain import Request, RequestKey

__all__ = ["RequestQueues"]

_SLACK = 64  # stale entries tolerated before a heap or an index is compacted

# Positions in a strategy-order entry `(*sort key, token, sort key)`.
_TOKEN, _KEY = -2, -1

_heappush = heapq.heappush
_heappop = heapq.heappop


class _TokenIndex:
    """Tokens ordered by (value, token) for a value that almost always grows with each
    push (arrival, deadline): an in-order push appends its token to `run`; one that is
    not (a retried request, a model with a shorter TTL) goes to the `late` heap."""

    __slots__ = ("last", "late", "run")

    def __init__(self) -> None:
        self.run: deque[int] = deque()  # values never decrease along it
        self.last = -math.inf  # the value of the last token appended to `run`
        self.late: list[tuple[float, int]] = []  # (value, token)

    def __len__(self) -> int:
        return len(self.run) + len(self.late)

    def add(self, value: float, token: int) -> None:
        if value >= self.last or not self.run:
            self.run.append(token)
            self.last = value
        else:
            _heappush(self.late, (value, token))

    def discard_head(self, token: int) -> None:
        """Drop `token` now if it is at a head (the usual removal: a grant, an expiry)."""
        if self.run and self.run[0] == token:
            self.run.popleft()
        elif self.late and self.late[0][1] == token:
            _heappop(self.late)

    def head(self, waiting: dict[int, Request], value_of: Any) -> tuple[float, int] | None:
        """(value, token) of the first live entry, dropping stale ones on the way."""
        run, late = self.run, self.late
        while run and run[0] not in waiting:
            run.popleft()
        while late and late[0][1] not in waiting:
            _heappop(late)
        first = (value_of(waiting[run[0]]), run[0]) if run else None
        if late and (first is None or late[0] < first):
            return late[0]
        return first

    def compact(self, waiting: dict[int, Request]) -> None:
        self.run = deque(token for token in self.run if token in waiting)
        self.late = [e for e in self.late if e[1] in waiting]
        heapq.heapify(self.late)


def _arrival_of(request: Request) -> int:
    return request.arrival


def _deadline_of(request: Request) -> float:
    return request.deadline


@dataclass(slots=True)
class _ModelHeaps:
    order: list[tuple[Any, ...]] = field(default_factory=list)  # (*sort key, token, sort key)
    arrival: _TokenIndex = field(default_factory=_TokenIndex)
    count: int = 0


class RequestQueues:
    """Every waiting request, by model, in the order of one `Ordering`."""

    def __init__(self, ordering: Ordering) -> None:
        self._ordering = ordering
        self._key = ordering.key
        self._models: dict[str, _ModelHeaps] = {}
        self._token_of: dict[RequestKey, int] = {}  # waiting request -> the token of its push
        self._waiting: dict[int, Request] = {}  # live token -> its request
        self._deadlines = _TokenIndex()
        self._tokens = itertools.count()

    @property
    def ordering(self) -> Ordering:
        return self._ordering

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, key: RequestKey) -> bool:
        return key in self._token_of

    def depth(self, model_id: str) -> int:
        heaps = self._models.get(model_id)
        return heaps.count if heaps is not None else 0

    def waiting_models(self) -> list[str]:
        """Models with at least one waiting request."""
        return list(self._models)

    def push(self, request: Request) -> None:
        key = request.key
        if key in self._token_of:
            raise ValueError(f"request {key} is already queued")
        token = next(self._tokens)
        self._token_of[key] = token
        self._waiting[token] = request
        heaps = self._models.get(request.model_id)
        if heaps is None:
            heaps = self._models[request.model_id] = _ModelHeaps()
        sort_key = self._key(request)
        _heappush(heaps.order, sort_key + (token, sort_key))  # noqa: RUF005 (faster than unpacking)
        heaps.arrival.add(request.arrival, token)
        heaps.count += 1
        self._deadlines.add(request.deadline, token)

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
        waiting = self._waiting
        while order[0][_TOKEN] not in waiting:  # a model with heaps has a live entry
            _heappop(order)
        head = order[0]
        return head[_KEY], waiting[head[_TOKEN]]

    def peek_oldest(self, model_id: str) -> Request | None:
        """The earliest-arrived request waiting for `model_id`, left in place."""
        heaps = self._models.get(model_id)
        if heaps is None:
            return None
        oldest = heaps.arrival.head(self._waiting, _arrival_of)
        assert oldest is not None  # a model with heaps has a live entry
        return self._waiting[oldest[1]]

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

    def of_model(self, model_id: str) -> list[Request]:
        """The requests waiting for `model_id` (any order)."""
        heaps = self._models.get(model_id)
        if heaps is None:
            return []
        waiting = self._waiting
        return [request for entry in heaps.order if (request := waiting.get(entry[_TOKEN])) is not None]

    def get(self, key: RequestKey) -> Request | None:
        token = self._token_of.get(key)
        return self._waiting[token] if token is not None else None

    def reordered(self, ordering: Ordering) -> RequestQueues:
        """The same waiting requests in a new queue under `ordering` (keys recomputed in
        arrival order, so stateful orderings see them as they came)."""
        queues = RequestQueues(ordering)
        for request in sorted(self.requests(), key=lambda r: r.arrival):
            queues.push(request)
        return queues

    def remove(self, key: RequestKey) -> Request | None:
        """Take `key` out of its queue; None if it was not waiting."""
        token = self._token_of.pop(key, None)
        if token is None:
            return None
        waiting = self._waiting
        request = waiting.pop(token)
        model_id = request.model_id
        heaps = self._models[model_id]
        count = heaps.count = heaps.count - 1
        if count == 0:
            del self._models[model_id]  # drops its stale entries with it
        else:
            # the usual removals take a head (a grant, drop_oldest): drop it now
            order = heaps.order
            if order[0][_TOKEN] == token:
                _heappop(order)
            arrival = heaps.arrival
            arrival.discard_head(token)
            limit = 2 * count + _SLACK
            if len(order) > limit:
                heaps.order = [e for e in order if e[_TOKEN] in waiting]
                heapq.heapify(heaps.order)
            if len(arrival.run) + len(arrival.late) > limit:
                arrival.compact(waiting)
        deadlines = self._deadlines
        deadlines.discard_head(token)
        if len(deadlines.run) + len(deadlines.late) > 2 * len(waiting) + _SLACK:
            deadlines.compact(waiting)
        return request

    def next_deadline(self) -> float | None:
        """The earliest deadline among waiting requests."""
        first = self._deadlines.head(self._waiting, _deadline_of)
        return first[0] if first is not None else None

    def pop_expired(self, now: float) -> list[Request]:
        """Remove and return every waiting request whose deadline is at or before `now`."""
        expired: list[Request] = []
        while (first := self._deadlines.head(self._waiting, _deadline_of)) is not None and first[0] <= now:
            request = self._waiting[first[1]]
            self.remove(request.key)
            expired.append(request)
        return expired

    def requests(self) -> list[Request]:
        """Every waiting request (any order)."""
        return list(self._waiting.values())
