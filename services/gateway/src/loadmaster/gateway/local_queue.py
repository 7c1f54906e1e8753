"""The gateway's own waiting room for models whose whole share of slots it holds.

While this gateway is a model's only user, the scheduler lends it every slot of the model as
dispatch credits, each carrying a `LocalQueue` spec (scheduler.proto). A call that then finds
no idle credit waits here instead of in the scheduler's queue, ranked by the scheduler's own
strategy code (`loadmaster.common.ordering`) with the same inputs: the client's latency budget,
its cadence (the same EWMA, over the arrivals this gateway sees, which with one gateway are all
of them), its calls not yet answered (waiting or running, as the scheduler counts them),
priority, urgency, steps. A call that finds an idle credit and runs at once still passes
through the ordering (`started`), as the scheduler's request granted on arrival does, so a
client's cadence and a round robin's rounds count it. So the order is the one the scheduler
would have kept, without a scheduler round trip per call (docs/data-path.md;
tests/integration/test_gateway_order.py checks it through the dispatcher).

Pure bookkeeping over an injected clock: the dispatcher pops the head when a credit frees,
hands everything to the scheduler when its credits are revoked, and asks what expired.
Removal is lazy: a heap entry is live while its token is in `_waiting`.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from loadmaster.common.clock import Clock
from loadmaster.common.ordering import ClientTracker, DeadlineTerms, Ordering, SortKey, make_ordering
from loadmaster.common.ordering.requests import Request, RequestInfo
from loadmaster.gateway.calls import InferenceCall
from loadmaster.v1 import scheduler_pb2

__all__ = ["LocalQueues", "Overflow"]

T = TypeVar("T")

log = logging.getLogger(__name__)

_DISCONNECT_TIMEOUT_S = 10.0  # a client silent this long is forgotten (its cadence starts afresh)


@dataclass(frozen=True, slots=True)
class Overflow(Generic[T]):
    """What a push into a full queue did: refused the newcomer, or dropped `dropped` (the oldest)."""

    refused: bool
    dropped: T | None
    message: str


@dataclass(slots=True)
class _Waiting(Generic[T]):
    item: T
    request: Request
    key: tuple[float, ...]


@dataclass(slots=True)
class _ModelQueue:
    spec: scheduler_pb2.LocalQueue
    ordering: Ordering
    heap: list[tuple[float, ...]] = field(default_factory=list)  # (*key, token)
    arrivals: deque[int] = field(default_factory=deque)  # tokens, oldest first (drop_oldest)
    size: int = 0


class LocalQueues(Generic[T]):
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._models: dict[str, _ModelQueue] = {}
        self._waiting: dict[int, _Waiting[T]] = {}  # token -> entry
        self._tokens: dict[str, int] = {}  # request id -> token
        self._deadlines: list[tuple[float, int]] = []  # (deadline, token)
        self._backlog: dict[tuple[str, str], int] = {}  # (client, model) -> its calls waiting here
        # (client, model) -> its calls started through here and not yet ended: the scheduler's
        # backlog term counts a client's unfinished requests, running ones included
        self._running: dict[tuple[str, str], set[str]] = {}
        self._clients = ClientTracker(cadence_alpha=0.3, disconnect_timeout_s=_DISCONNECT_TIMEOUT_S)
        self._seq = itertools.count(1)

    def __len__(self) -> int:
        return len(self._waiting)

    def waiting(self, model_id: str) -> int:
        queue = self._models.get(model_id)
        return queue.size if queue is not None else 0

    def accepts(self, model_id: str) -> bool:
        """New calls for the model may wait here."""
        queue = self._models.get(model_id)
        return queue is not None and bool(queue.spec.strategy)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tokens

    def configure(self, model_id: str, spec: scheduler_pb2.LocalQueue | None) -> None:
        """Queue the model's calls by `spec` from now on (the calls already waiting keep their
        keys), or with None (or a spec with no strategy: a scheduler from before every credit
        carried one) stop taking new ones (those waiting stay until taken)."""
        queue = self._models.get(model_id)
        if spec is None or not spec.strategy:
            if queue is not None and not queue.size:
                del self._models[model_id]
            elif queue is not None:
                queue.spec = scheduler_pb2.LocalQueue()  # draining: `accepts` says no below
            return
        if queue is not None and queue.spec == spec:
            return
        terms = DeadlineTerms(
            priority_step_ms=spec.priority_step_ms,
            urgency_weight=spec.urgency_weight,
            steps_horizon=spec.steps_horizon,
            service_ms=spec.service_ms,
        )
        try:
            ordering = make_ordering(
                spec.strategy, policy=spec.policy, terms=terms, tiers=list(spec.tiers) or None
            )
        except ValueError as error:  # a policy whose module this gateway did not import
            log.error("model %s: %s; its calls here are ranked without the policy", model_id, error)
            ordering = make_ordering(spec.strategy, terms=terms, tiers=list(spec.tiers) or None)
        if queue is None:
            self._models[model_id] = _ModelQueue(spec, ordering)
        else:
            queue.spec, queue.ordering = spec, ordering
        self._clients = _retuned(self._clients, spec.cadence_alpha)

    def push(self, item: T, call: InferenceCall, ttl_ms: float) -> Overflow[T] | None:
        """Queue `item` (for `call`, waiting at most `ttl_ms`); None, or what overflow did."""
        model_id = call.model_id
        queue = self._models[model_id]
        spec = queue.spec
        overflow: Overflow[T] | None = None
        if spec.max_queue_size and queue.size >= spec.max_queue_size:
            full = f"queue for model {model_id!r} is full ({spec.max_queue_size} waiting)"
            if spec.reject_newest:
                return Overflow(True, None, full)
            oldest = self._pop_oldest(queue)
            overflow = Overflow(False, oldest, f"{full}; dropped the oldest")
        token = next(self._seq)
        request = self._request(queue, call, ttl_ms, token)
        if call.client_id:
            stream = (call.client_id, model_id)
            self._backlog[stream] = self._backlog.get(stream, 0) + 1
        key = queue.ordering.key(request)
        self._waiting[token] = _Waiting(item, request, key)
        self._tokens[call.request_id] = token
        heapq.heappush(queue.heap, (*key, token))
        queue.arrivals.append(token)
        queue.size += 1
        heapq.heappush(self._deadlines, (request.deadline, token))
        return overflow

    def started(self, call: InferenceCall, ttl_ms: float) -> None:
        """`call` found an idle credit and runs without waiting: the ordering sees it arrive and
        be served at once, as the scheduler's does a request granted on arrival, so the clients'
        cadences and a round robin's rounds stay the ones the scheduler would keep."""
        queue = self._models.get(call.model_id)
        if queue is None or not queue.spec.strategy:
            return
        request = self._request(queue, call, ttl_ms, next(self._seq))
        queue.ordering.granted(request, queue.ordering.key(request))
        self._run(request)

    def ended(self, call: InferenceCall) -> None:
        """A call started through here (at once or from the queue) has its answer."""
        stream = (call.client_id, call.model_id)
        running = self._running.get(stream)
        if running is not None:
            running.discard(call.request_id)
            if not running:
                del self._running[stream]

    def _run(self, request: Request) -> None:
        if request.info.client_id:
            self._running.setdefault((request.info.client_id, request.model_id), set()).add(
                request.info.request_id
            )

    def _request(self, queue: _ModelQueue, call: InferenceCall, ttl_ms: float, token: int) -> Request:
        """The ordering's view of `call` arriving now (its client's cadence observed)."""
        spec = queue.spec
        now = self._clock.monotonic()
        client_id = call.client_id
        cadence_ms: float | None = None
        backlog = 0
        if client_id:
            if not call.connection_bound:
                self._clients.observe(client_id, now)
                cadence_ms = self._clients.cadence_ms(client_id)
            stream = (client_id, call.model_id)
            backlog = self._backlog.get(stream, 0) + len(self._running.get(stream, ()))
        ttl_s = ttl_ms / 1000.0
        return Request(
            (0, call.request_id),
            RequestInfo(
                call.request_id,
                call.model_id,
                client_id,
                call.priority,
                call.urgency,
                call.timeout_ms,
                call.steps_remaining,
            ),
            token,  # arrival
            now,  # enqueued_at
            now + ttl_s,  # deadline
            int((self._clock.time() + ttl_s) * 1e9),
            spec.client_latency_budget_ms.get(client_id, spec.latency_budget_ms),
            cadence_ms,
            backlog,
        )

    def stage(self, model_id: str) -> int:
        """How many calls may wait at a busy credit's worker behind the one running (the spec's)."""
        queue = self._models.get(model_id)
        return queue.spec.stage if queue is not None else 0

    def peek(self, model_id: str) -> tuple[SortKey, T] | None:
        """The model's next call in strategy order and its key (lower runs first), or None."""
        queue = self._models.get(model_id)
        if queue is None or (token := self._head(queue)) is None:
            return None
        return queue.heap[0][:-1], self._waiting[token].item

    def budget_ms(self, model_id: str, client_id: str) -> float:
        """The client's latency budget, as the model's spec gives it (0: no spec)."""
        queue = self._models.get(model_id)
        if queue is None:
            return 0.0
        return queue.spec.client_latency_budget_ms.get(client_id, queue.spec.latency_budget_ms)

    def ranks_by_priority(self, model_id: str) -> bool:
        """The model's strategy puts a more urgent client's call first (all but a round robin)."""
        queue = self._models.get(model_id)
        return queue is not None and queue.spec.strategy not in ("", "round_robin")

    def outstanding(self, client_id: str, model_id: str) -> bool:
        """The client has a call for the model waiting here or running."""
        stream = (client_id, model_id)
        return stream in self._backlog or bool(self._running.get(stream))

    def pop(self, model_id: str) -> T | None:
        """The model's next call in strategy order, or None."""
        queue = self._models.get(model_id)
        if queue is None or (token := self._head(queue)) is None:
            return None
        heapq.heappop(queue.heap)
        entry = self._waiting[token]
        queue.ordering.granted(entry.request, entry.key)
        self._drop(token, queue)
        self._run(entry.request)
        return entry.item

    def _head(self, queue: _ModelQueue) -> int | None:
        """The token of the queue's next waiting call; entries of calls gone meanwhile are dropped."""
        heap = queue.heap
        while heap and int(heap[0][-1]) not in self._waiting:
            heapq.heappop(heap)
        return int(heap[0][-1]) if heap else None

    def remove(self, request_id: str) -> T | None:
        token = self._tokens.get(request_id)
        if token is None:
            return None
        entry = self._waiting[token]
        self._drop(token, self._models[entry.request.model_id])
        return entry.item

    def take_all(self, model_id: str) -> list[T]:
        """Every call waiting for the model, in strategy order (to hand to the scheduler)."""
        taken: list[T] = []
        while (item := self.pop(model_id)) is not None:
            taken.append(item)
        return taken

    def next_deadline(self) -> float | None:
        deadlines = self._deadlines
        while deadlines and deadlines[0][1] not in self._waiting:
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else None

    def expired(self) -> list[tuple[T, str]]:
        """Calls whose deadline has passed, each with the error message the scheduler gives."""
        now = self._clock.monotonic()
        out: list[tuple[T, str]] = []
        while (deadline := self.next_deadline()) is not None and deadline <= now:
            token = heapq.heappop(self._deadlines)[1]
            entry = self._waiting[token]
            request = entry.request
            self._drop(token, self._models[request.model_id])
            waited_ms = (now - request.enqueued_at) * 1000.0
            out.append(
                (entry.item, f"expired after waiting {waited_ms:.0f} ms for model {request.model_id!r}")
            )
        return out

    def forget_silent_clients(self) -> None:
        """Drop the cadence and ordering state of clients silent past the timeout."""
        for client_id in self._clients.due_disconnects(self._clock.monotonic()):
            for queue in self._models.values():
                queue.ordering.forget_client(client_id)

    def _pop_oldest(self, queue: _ModelQueue) -> T | None:
        while queue.arrivals:
            token = queue.arrivals.popleft()
            entry = self._waiting.get(token)
            if entry is not None:
                self._drop(token, queue)
                return entry.item
        return None

    def _drop(self, token: int, queue: _ModelQueue) -> None:
        entry = self._waiting.pop(token)
        request = entry.request
        del self._tokens[request.request_id]
        queue.size -= 1
        client_id = request.info.client_id
        if client_id:
            stream = (client_id, request.model_id)
            left = self._backlog[stream] - 1
            if left:
                self._backlog[stream] = left
            else:
                del self._backlog[stream]
        if not queue.size:
            queue.heap.clear()
            queue.arrivals.clear()
            if not queue.spec.strategy:  # stopped taking calls and now empty
                del self._models[request.model_id]


def _retuned(clients: ClientTracker, alpha: float) -> ClientTracker:
    """The tracker with the scheduler's cadence weight (a new one when it differs)."""
    if alpha <= 0.0 or alpha >= 1.0 or clients.alpha == alpha:
        return clients
    return ClientTracker(cadence_alpha=alpha, disconnect_timeout_s=_DISCONNECT_TIMEOUT_S)
