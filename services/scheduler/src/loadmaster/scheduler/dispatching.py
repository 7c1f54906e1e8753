"""Which queued request goes to which worker next, and which worker loads a model that
requests wait for.

`GrantDispatcher` is the core's collaborator for dispatch: admission, completion, clients
and credits stay in `core.SchedulerCore`, which owns one and calls `dispatch` with the
models whose queues or workers changed. Per strategy scope it grants queue heads, lends the free slots of
models with empty queues as dispatch credits, and commands loads: a load refused for GPU
memory keeps its waiters behind the VRAM gate and is commanded again later, and a request
that cannot wait for its model's load is refused at admission (docs/vram-gate.md). It shares the core's
bookkeeping (passed in, never re-bound by either side) and owns what only dispatch keeps:
the grants placed in one dispatch.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Mapping

from loadmaster.common.clock import Clock
from loadmaster.common.ordering import Scope
from loadmaster.scheduler import placement
from loadmaster.scheduler.config import CoreConfig
from loadmaster.scheduler.credits import CreditBook, local_queue_spec
from loadmaster.scheduler.domain import Grant, LoadModel, LocalQueueSpec, Request, RequestKey, SlotStatus
from loadmaster.scheduler.loads import LoadTracker, freed_memory, is_memory_error, load_outlasts
from loadmaster.scheduler.outbound import Outbound, Telemetry
from loadmaster.scheduler.queues import RequestQueues
from loadmaster.scheduler.registry import WorkerRegistry
from loadmaster.scheduler.tracking import ModelStats, Outstanding, Tracked

__all__ = ["GrantDispatcher"]

log = logging.getLogger(__name__)


class GrantDispatcher:
    def __init__(
        self,
        config: CoreConfig,
        *,
        clock: Clock,
        outbound: Outbound,
        telemetry: Telemetry,
        queues: RequestQueues,
        registry: WorkerRegistry,
        credits: CreditBook,
        loads: LoadTracker,
        tracked: Mapping[RequestKey, Tracked],
        outstanding: Outstanding,
        stats: Mapping[str, ModelStats],
        expire: Callable[[Request], None],
        hand_back: Callable[[Request], None],
        rng: random.Random,
    ) -> None:
        self._config = config
        self._clock = clock
        self._out = outbound
        self._telemetry = telemetry
        self.queues = queues  # the core replaces it when the strategy changes
        self._registry = registry
        self._credits = credits
        self._loads = loads
        self._tracked = tracked  # key -> its admitted, unfinished request (the core's)
        self._outstanding = outstanding  # client -> model -> its unfinished requests (the core's)
        self._stats = stats  # model -> counts (the core's; a queued request's model has one)
        self._expire = expire  # answers a request whose deadline passed while it waited
        self._hand_back = hand_back  # sends a waiting request back to its gateway's local queue
        self._rng = rng
        self._placed: dict[tuple[str, str], int] = {}  # (model, worker) -> grants this dispatch

    # ---- what the core asks -------------------------------------------------------

    def dispatch(self, models: Iterable[str]) -> None:
        """Grant what `models`' queues and workers allow now, then lend or revoke their
        credits and command the loads their waiters need."""
        models = list(models)
        if not models:
            return
        now = self._clock.monotonic()
        ordering = self.queues.ordering
        for model_id in models:
            if self.queues.depth(model_id) and self._may_share(model_id):
                self._to_shares(model_id, now)
        if ordering.batch is not None:
            for model_id in models:
                self._dispatch_batch(model_id, now)
        elif ordering.scope is Scope.GLOBAL and len(models) > 1:
            self._dispatch_global(models, now)
        else:
            for model_id in models:
                self._dispatch_model(model_id, now)
        for model_id in models:
            self._maybe_load(model_id)
            if (spec := self._lendable(model_id)) is None:
                self._credits.revoke_model(model_id)  # none out but after a worker joined past the cap
            elif not self.queues.depth(model_id):
                self._credits.lend(
                    model_id,
                    now,
                    ttl_ms=self._config.policy(model_id).request_ttl_ms,
                    pick=lambda m=model_id: self._pick_worker(m),
                    spec=spec,
                )
            if model_id in self._stats:  # waiting here and in the gateways' local queues, as GetQueues
                depth = self.queues.depth(model_id) + self._credits.local_depth(model_id)
                self._telemetry.record("queue_depth", depth, {"model": model_id})
        if self._placed:
            for (model_id, worker_id), count in self._placed.items():
                labels = {"model": model_id, "worker": worker_id}
                self._telemetry.record("grants", count, labels)
                self._telemetry.record("placement_decisions", count, {**labels, "kind": "grant"})
            self._placed.clear()

    def _lendable(self, model_id: str) -> LocalQueueSpec | None:
        """The spec the model's credits carry, or None when it is not lent: credits are off
        (`dispatch_credits` 0), its strategy or `latest_only` needs the central queue, or it has
        more slots than `dispatch_credits`. Every slot of a lent model is lent, so no gateway's
        queued call waits while a slot nobody holds stays idle."""
        policy = self._config.policy(model_id)
        if not policy.dispatch_credits:
            return None
        slots = len(self._registry.grant_candidates(model_id)) * self._config.max_inflight(model_id)
        if slots > policy.dispatch_credits:
            return None
        return local_queue_spec(self.queues.ordering, policy, self._config)

    def _may_share(self, model_id: str) -> bool:
        """Requests waiting here for the model may go to gateways' local queues: its slots are
        lent, or none is and it may be, and more wait than its free slots take. (At overload,
        as after a switch from a strategy the gateways cannot keep, its queue here never
        empties, and lending waits for an empty queue.)"""
        if self._credits.lent(model_id):
            return True
        if self._lendable(model_id) is None:
            return False
        return self.queues.depth(model_id) > self._free_slots(model_id)

    def _free_slots(self, model_id: str) -> int:
        candidates = self._registry.grant_candidates(model_id)
        return len(candidates) * self._config.max_inflight(model_id) - sum(c.inflight for c in candidates)

    def _to_shares(self, model_id: str, now: float) -> None:
        """The model's slots are lent with local queues, yet requests wait here: those of a
        gateway that holds a share go back to its local queue; a gateway without one is lent a
        free slot for them, or one is reclaimed for it. Requests of gateways that take no
        credits, and retries (their attempts are counted here), are granted here: a slot is
        reclaimed for each."""
        policy = self._config.policy(model_id)
        spec = local_queue_spec(self.queues.ordering, policy, self._config)
        by_session: dict[int, list[Request]] = {}
        slots = 0  # that requests here still need
        for request in self.queues.of_model(model_id):
            tracked = self._tracked.get(request.key)
            if tracked is not None and tracked.attempts:
                slots += 1
            else:
                by_session.setdefault(request.key[0], []).append(request)
        for session_id, requests in by_session.items():
            if spec is None or not self._credits.accepts(session_id):
                slots += len(requests)
            elif self._credits.holds_share(session_id, model_id) or self._credits.lend_to(
                model_id,
                session_id,
                now,
                ttl_ms=policy.request_ttl_ms,
                pick=lambda: self._pick_worker(model_id),
                spec=spec,
            ):
                for request in sorted(requests, key=lambda r: r.arrival):
                    self._hand_back(request)
            else:
                slots += 1
        self._credits.reclaim(model_id, slots - self._free_slots(model_id))

    def _head(self, model_id: str, now: float) -> tuple[tuple[float, ...], Request] | None:
        """The next request for `model_id`, expiring any whose deadline has passed."""
        queues = self.queues
        while (entry := queues.peek_entry(model_id)) is not None:
            head = entry[1]
            if head.deadline > now:
                return entry
            queues.remove(head.key)
            self._expire(head)
        return None

    def _pick_worker(self, model_id: str, *, affinity_key: str = "") -> str | None:
        return placement.pick_grant_worker(
            self._registry.grant_candidates(model_id),
            max_inflight=self._config.max_inflight(model_id),
            rng=self._rng,
            affinity_key=affinity_key,
        )

    def _dispatch_model(self, model_id: str, now: float) -> None:
        while (entry := self._head(model_id, now)) is not None:
            worker_id = self._pick_worker(model_id, affinity_key=entry[1].info.affinity_key)
            if worker_id is None:
                break
            self._grant_head(entry, worker_id, now)

    def _dispatch_global(self, models: list[str], now: float) -> None:
        """One order across models: the smallest head key among models a worker can take goes first."""
        active = set(models)
        while active:
            best: tuple[tuple[float, ...], Request, str] | None = None
            for model_id in list(active):
                entry = self._head(model_id, now)
                worker_id = (
                    self._pick_worker(model_id, affinity_key=entry[1].info.affinity_key)
                    if entry is not None
                    else None
                )
                if entry is None or worker_id is None:
                    active.discard(model_id)
                elif best is None or entry[0] < best[0]:
                    best = (entry[0], entry[1], worker_id)
            if best is None:
                return
            self._grant_head((best[0], best[1]), best[2], now)

    def next_batch_release(self, now: float) -> float | None:
        """When the earliest waiting group is released by time (None: no batch rule, or none)."""
        rule = self.queues.ordering.batch
        if rule is None:
            return None
        earliest: float | None = None
        for model_id in self.queues.waiting_models():
            if self.queues.depth(model_id) >= rule.max_batch_size:
                continue  # released as soon as a worker has room, not by time
            oldest = self.queues.peek_oldest(model_id)
            if oldest is None:
                continue
            release = oldest.enqueued_at + rule.max_wait_s
            # A group already due is waiting for room (a completion releases it), unless a
            # worker has room now: then the dispatch that found it not yet due read the clock
            # a moment before `release` (a timer fires up to 1 ms early), and without a wake-up
            # here it would wait for its TTL.
            if (release > now or self.batch_room(model_id)) and (earliest is None or release < earliest):
                earliest = release
        return earliest

    def batch_room(self, model_id: str) -> bool:
        """Some worker holding `model_id` READY has a free slot for a group."""
        max_inflight = self._config.max_inflight(model_id)
        return (
            placement.pick_batch_worker(self._registry.grant_candidates(model_id), max_inflight=max_inflight)
            is not None
        )

    def _dispatch_batch(self, model_id: str, now: float) -> None:
        """Release groups of up to max_batch_size, each to one worker, once full or old enough."""
        rule = self.queues.ordering.batch
        assert rule is not None
        max_inflight = self._config.max_inflight(model_id)
        while True:
            depth = self.queues.depth(model_id)
            oldest = self.queues.peek_oldest(model_id)
            if oldest is None:
                return
            if depth < rule.max_batch_size and now < oldest.enqueued_at + rule.max_wait_s:
                return  # the timer releases it at oldest + max_wait
            chosen = placement.pick_batch_worker(
                self._registry.grant_candidates(model_id), max_inflight=max_inflight
            )
            if chosen is None:
                return
            worker_id, room = chosen
            for _ in range(min(room, rule.max_batch_size)):
                entry = self._head(model_id, now)
                if entry is None:
                    return
                self._grant_head(entry, worker_id, now)

    def _grant_head(self, entry: tuple[tuple[float, ...], Request], worker_id: str, now: float) -> None:
        key, request = entry
        self.queues.remove(request.key)
        self.queues.ordering.granted(request, key)
        tracked = self._tracked[request.key]
        model_id = request.model_id
        record = self._registry.get(worker_id)
        assert record is not None
        slot = record.slots[model_id]
        self._registry.acquire(worker_id, request.key, model_id)
        tracked.worker_id = worker_id
        tracked.attempts += 1
        self._stats[model_id].granted += 1
        grant = Grant(  # positional, in Grant's field order (see `Request(` in _enqueue)
            request.request_id,
            worker_id,
            record.hello.data_endpoint,
            slot.generation,
            request.deadline_unix_ns,
            tracked.attempts,
        )
        self._out.grant(request.session_id, grant)
        self._telemetry.record(
            "scheduling_wait_ms", (now - request.enqueued_at) * 1000.0, {"model": model_id}
        )
        placed = (model_id, worker_id)
        self._placed[placed] = self._placed.get(placed, 0) + 1  # recorded once per dispatch

    # ---- cold starts: which worker loads a model that requests wait for ------------

    def load_outcomes(
        self, worker_id: str, previous: Mapping[str, SlotStatus], current: Mapping[str, SlotStatus]
    ) -> dict[str, str]:
        """A worker's new report: settle its loads. A load refused for memory that could free up
        puts its model behind the VRAM gate (its waiters stay queued); an unload lets gated
        loads try again at once. Returns model -> error of the failures that end their waiters."""
        loads = self._loads
        failures = loads.observe(worker_id, previous, current)
        now = self._clock.monotonic()
        if loads.gating and freed_memory(previous, current, failures):
            loads.retry_all(now)  # an unload gave memory back
        final: dict[str, str] = {}
        for model_id, error in failures.items():
            if self._registry.holds(model_id):
                continue
            if is_memory_error(error) and self.queues.depth(model_id):
                first = loads.gated(model_id) is None
                loads.gate(model_id, error, now=now, retry_s=self._config.vram_gate_retry_ms / 1000.0)
                if first:
                    log.info("model %s waits for GPU memory on %s: %s", model_id, worker_id, error)
                    self._telemetry.record("vram_gate_waits", 1, {"model": model_id})
                continue
            final[model_id] = error
        return final

    def load_outlasts(self, model_id: str, ttl_ms: float, now: float) -> str | None:
        """Load time counts against the deadline: the refusal for a request that cannot wait for
        `model_id`'s load (None: warm, waiting for memory, no estimate, or time enough)."""
        if self._registry.grant_candidates(model_id) or self._loads.gated(model_id) is not None:
            return None
        return load_outlasts(
            model_id,
            load_ms=self._registry.load_time_ms(model_id),
            commanded_at=self._loads.commanded_at(model_id),
            ttl_ms=ttl_ms,
            now=now,
        )

    def waiting_for(self, model_id: str, now: float) -> str:
        """What a request for `model_id` that expires now was waiting for, as the end of its
        message: GPU memory (the VRAM gate), a load in progress, or nothing known ("")."""
        if (gate := self._loads.gated(model_id)) is not None:
            return (
                f": it was waiting for GPU memory to load the model "
                f"(for {(now - gate.since) * 1000.0:.0f} ms; {gate.reason})"
            )
        if not self._registry.grant_candidates(model_id) and (
            model_id in self._loads or self._registry.holds(model_id)
        ):
            return ": the model was still loading"
        return ""

    def _maybe_load(self, model_id: str) -> None:
        loads = self._loads
        if not self.queues.depth(model_id):
            if loads.gating:
                loads.ungate(model_id)  # nobody waits for it any more
            return
        if model_id in loads or self._registry.holds(model_id):
            if loads.gating and self._registry.grant_candidates(model_id):
                loads.ungate(model_id)  # it found memory and is READY
            return
        if loads.blocked(model_id, self._clock.monotonic()):
            return  # the VRAM gate: its last load found no memory; the next try is at retry_at
        self._command_load(model_id)

    def _command_load(self, model_id: str) -> None:
        candidates = self._registry.load_candidates(model_id, busy=lambda m: self.queues.depth(m) > 0)
        worker_id = placement.pick_load_worker(candidates, vram_mb=self._config.policy(model_id).vram_mb)
        if worker_id is None:
            return  # nobody can load it now; waiters expire unless a worker turns up
        record = self._registry.get(worker_id)
        assert record is not None
        self._loads.commanded(model_id, worker_id, record.slots.get(model_id), now=self._clock.monotonic())
        self._loads.attempting(model_id)
        log.info("commanding worker %s to load model %s", worker_id, model_id)
        self._out.command(worker_id, LoadModel(model_id))
        self._telemetry.record("loads_commanded", 1, {"model": model_id, "worker": worker_id})
        self._telemetry.record(
            "placement_decisions", 1, {"model": model_id, "worker": worker_id, "kind": "load"}
        )
