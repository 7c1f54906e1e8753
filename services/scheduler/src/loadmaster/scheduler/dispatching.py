"""Which queued request goes to which worker next, and which worker loads a model that
requests wait for.

`GrantDispatcher` is the core's collaborator for dispatch: admission, completion, clients
and credits stay in `core.SchedulerCore`, which owns one and calls `dispatch` with the
models whose queues or workers changed. Per strategy scope it grants queue heads (opening
lookahead windows and holding slots for reservations on the way), lends the free slots of
models with empty queues as dispatch credits, and commands loads: a load refused for GPU
memory keeps its waiters behind the VRAM gate and is commanded again later, and a request
that cannot wait for its model's load is refused at admission (docs/vram-gate.md). It shares the core's
bookkeeping (passed in, never re-bound by either side) and owns what only dispatch keeps:
the slots held for reservations and the grants placed in one dispatch.
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
from loadmaster.scheduler.domain import Grant, LoadModel, Request, RequestKey, SlotStatus
from loadmaster.scheduler.loads import LoadTracker, freed_memory, is_memory_error, load_outlasts
from loadmaster.scheduler.lookahead import Lookahead
from loadmaster.scheduler.outbound import Outbound, Telemetry
from loadmaster.scheduler.queues import RequestQueues
from loadmaster.scheduler.registry import WorkerRegistry
from loadmaster.scheduler.reservations import Reservations
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
        lookahead: Lookahead,
        reservations: Reservations,
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
        self._lookahead = lookahead
        self._reservations = reservations
        self._loads = loads
        self._tracked = tracked  # key -> its admitted, unfinished request (the core's)
        self._outstanding = outstanding  # client -> model -> its unfinished requests (the core's)
        self._stats = stats  # model -> counts (the core's; a queued request's model has one)
        self._expire = expire  # answers a request whose deadline passed while it waited
        self._hand_back = hand_back  # sends a waiting request back to its gateway's local queue
        self._rng = rng
        self._held: dict[str, float] = {}  # model -> when its slot held for an arrival lapses
        self._placed: dict[tuple[str, str], int] = {}  # (model, worker) -> grants this dispatch

    # ---- what the core asks -------------------------------------------------------

    def next_hold_lapse(self) -> float | None:
        """When the earliest slot held for a predicted arrival lapses (None: none held)."""
        return min(self._held.values()) if self._held else None

    def drop_lapsed_holds(self, now: float) -> bool:
        """Forget the holds lapsed by `now` (a model whose waiters are gone is dispatched by
        nobody, so its hold would stay due); True if any was held, lapsed or not."""
        if not self._held:
            return False
        self._held = {model_id: until for model_id, until in self._held.items() if until > now}
        return True

    def dispatch(self, models: Iterable[str]) -> None:
        """Grant what `models`' queues and workers allow now, then lend or revoke their
        credits and command the loads their waiters need."""
        models = list(models)
        if not models:
            return
        now = self._clock.monotonic()
        ordering = self.queues.ordering
        for model_id in models:
            if self.queues.depth(model_id) and self._credits.queue_locally(model_id):
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
            if self.queues.depth(model_id):
                if not self._credits.queue_locally(model_id):
                    self._credits.revoke_model(model_id, now)
            elif (policy := self._config.policy(model_id)).dispatch_credits and ordering.batch is None:
                self._credits.lend(
                    model_id,
                    now,
                    limit=policy.dispatch_credits,
                    ttl_ms=policy.request_ttl_ms,
                    pick=lambda m=model_id: self._pick_worker(m, ahead=False),
                    local_queue=lambda m=model_id, p=policy: local_queue_spec(
                        ordering, p, self._config, self._lookahead.inference_s(m)
                    ),
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

    def _to_shares(self, model_id: str, now: float) -> None:
        """The model's slots are lent with local queues, yet requests wait here: those of a
        gateway that holds a share go back to its local queue; a gateway without one is lent a
        free slot for them, or one is reclaimed for it. Requests of gateways that take no
        credits, and retries (their attempts are counted here), are granted here: a slot is
        reclaimed for each."""
        policy = self._config.policy(model_id)
        spec = local_queue_spec(
            self.queues.ordering, policy, self._config, self._lookahead.inference_s(model_id)
        )
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
                pick=lambda: self._pick_worker(model_id, ahead=False),
                spec=spec,
            ):
                for request in sorted(requests, key=lambda r: r.arrival):
                    self._hand_back(request)
            else:
                slots += 1
        self._credits.reclaim(model_id, slots)

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

    def _pick_worker(self, model_id: str, *, ahead: bool = True, affinity_key: str = "") -> str | None:
        return placement.pick_grant_worker(
            self._registry.grant_candidates(model_id),
            max_inflight=self._config.max_inflight(model_id),
            rng=self._rng,
            ahead=ahead,
            affinity_key=affinity_key,
        )

    # ---- lookahead windows (lookahead.py) ------------------------------------------

    def _open_windows(self, model_id: str, now: float) -> None:
        """Let busy slots of `model_id` whose lookahead window is due take grants ahead; close
        the windows whose prediction has passed."""
        if not self._lookahead.active:
            return
        opened, closed = self._lookahead.update(model_id, now)
        if opened:
            for worker_id in opened:
                self._set_ahead(worker_id, model_id, self._window_depth(worker_id, model_id))
        for worker_id in closed:
            self._set_ahead(worker_id, model_id, 0)

    def close_window(self, where: tuple[str, str] | None) -> None:
        if where is not None:
            self._set_ahead(*where, 0)

    def _set_ahead(self, worker_id: str, model_id: str, ahead: int) -> None:
        record = self._registry.get(worker_id)
        candidate = record.candidates.get(model_id) if record is not None else None
        if candidate is not None:
            candidate.ahead = ahead

    def _too_late(self, request: Request, worker_id: str, now: float, *, front: bool = False) -> bool:
        """With lookahead on, a head that would reach its worker (or, staged, its turn) only
        after its deadline is answered `expired` now, so it does not take the slot to be
        refused there: under overload, the slot would sit idle for a dispatch round trip."""
        if not self._lookahead.active or not self._config.policy(request.model_id).lookahead:
            return False
        if not self._lookahead.too_late(worker_id, request.model_id, request.deadline, now, front=front):
            return False
        self.queues.remove(request.key)
        self._expire(request)
        return True

    def reopen_windows(self, worker_id: str) -> None:
        """A report rebuilt the worker's candidates: give the open windows back to them."""
        for model_id in self._lookahead.open_models(worker_id):
            self._set_ahead(worker_id, model_id, self._window_depth(worker_id, model_id))

    def _window_depth(self, worker_id: str, model_id: str) -> int:
        """Grants an open window takes: the model's lookahead, plus one per staged request
        that will be refused rather than run (Lookahead.doomed)."""
        return self._config.policy(model_id).lookahead + self._lookahead.doomed(worker_id, model_id)

    # ---- reservations (reservations.py) ---------------------------------------------

    def _hold_for_urgent(self, entry: tuple[tuple[float, ...], Request], now: float) -> bool:
        """Granting the head now would make a more urgent client's next request late: keep the
        model's slot free for it (until `_held[model]`, when the next dispatch looks again)."""
        key, request = entry
        model_id = request.model_id
        if not self._reservations.may_hold(model_id, request.info.priority):
            return False
        if not self._config.policy(model_id).reservation:
            return False
        timing = self._lookahead.timing(model_id)
        if timing is None:
            return False
        max_inflight = self._config.max_inflight(model_id)
        workers = [(c.worker_id, max_inflight) for c in self._registry.grant_candidates(model_id)]
        hold = self._reservations.hold_until(
            request,
            key,
            places=self._lookahead.places(model_id, workers, now),
            timing=timing,
            now=now,
            predicted_key=self.queues.ordering.predicted_key,
            queued=lambda client_id: self._queued(client_id, model_id),
        )
        if hold is None:
            return False
        self._held[model_id] = hold.until
        self._telemetry.record("slot_holds", 1, {"model": model_id})
        return True

    def _queued(self, client_id: str, model_id: str) -> bool:
        return any(key in self.queues for key in self._outstanding.keys(client_id, model_id))

    def _dispatch_model(self, model_id: str, now: float) -> None:
        max_inflight = self._config.max_inflight(model_id)
        self._open_windows(model_id, now)
        self._held.pop(model_id, None)
        while (entry := self._head(model_id, now)) is not None:
            worker_id = placement.pick_grant_worker(
                self._registry.grant_candidates(model_id),
                max_inflight=max_inflight,
                rng=self._rng,
                affinity_key=entry[1].info.affinity_key,
            )
            front = False
            if worker_id is None:
                if not self._lookahead.active:
                    break
                # more urgent than a request staged on a busy slot: ahead of it at the worker
                worker_id = self._lookahead.front_target(model_id, entry[0], now)
                if worker_id is None:
                    break
                front = True
            if self._too_late(entry[1], worker_id, now, front=front):
                continue
            if self._hold_for_urgent(entry, now):
                break
            self._grant_head(entry, worker_id, now, front=front)

    def _dispatch_global(self, models: list[str], now: float) -> None:
        """One order across models: the smallest head key among models a worker can take goes first."""
        active = set(models)
        for model_id in models:
            self._open_windows(model_id, now)
            self._held.pop(model_id, None)
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
            if self._too_late(best[1], best[2], now):
                continue
            if self._hold_for_urgent((best[0], best[1]), now):
                active.discard(best[1].model_id)
                continue
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

    def _grant_head(
        self, entry: tuple[tuple[float, ...], Request], worker_id: str, now: float, *, front: bool = False
    ) -> None:
        key, request = entry
        self.queues.remove(request.key)
        self.queues.ordering.granted(request, key)
        tracked = self._tracked[request.key]
        model_id = request.model_id
        record = self._registry.get(worker_id)
        assert record is not None
        slot = record.slots[model_id]
        self._registry.acquire(worker_id, request.key, model_id)
        if self._config.policy(model_id).lookahead and self.queues.ordering.batch is None:
            self._lookahead.granted(
                worker_id,
                model_id,
                request.key,
                now,
                max_inflight=self._config.max_inflight(model_id),
                sort_key=key,
                deadline=request.deadline,
                front=front,
            )
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
            front,
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
