"""The scheduler inside transformers' continuous-batching manager: priority, fairness, preemption.

transformers' manager picks each step's batch with a `Scheduler` (FIFO or prefill-first);
`install` registers this one instead, so the queue in front of the engine is the engine's
own and it orders by Loadmaster's policy (`generation_order.py`, docs/generation-scheduling.md).
It runs on the manager's thread, once per step, so an urgent request is seen at the very
next step, with nothing a network hop or a loop turn away:

- at most `resident` sequences (the model's `max_resident_sequences`) hold their KV cache;
  the rest wait, ordered by (class, tenant counter, arrival);
- each step carries at most `max_requests_per_batch` (the model's `max_sequences`) of the
  resident ones: by class, then fairly between tenants (each place to the tenant whose
  counter, plus what the step already gives it, is lowest), a new sequence's prefill first
  within a tenant, then the one that waited longest for a step;
- a class-0 request that finds every place taken by lower-class work pauses the lowest-class
  sequence (with `timeslice_tokens`, better-class work also takes the place of a sequence
  that used its slice). A paused sequence keeps its KV cache: it simply is not in the batch
  until it resumes, so no token is lost, repeated or recomputed. Only when the cache has no
  room left for running work is a paused sequence's cache freed ("soft reset": it resumes
  by prefilling its prompt and the tokens it has, which transformers supports; with our
  seeded sampling it draws the same continuation);
- while a class-0 request waits for its first token, the step carries only class-0 work:
  the urgent prefill does not wait for a decode step over the whole batch;
- while urgent work runs, and for `URGENT_HOLD_S` after the last of it, a step carries at
  most `URGENT_LOW_SHARE` of the places' worth of lower-class sequences (those that waited
  longest for a step first), so the step an urgent arrival waits for is short; lower-class
  work gives up throughput only while urgent work is about;
- output tokens are charged to their tenants' counters as each step is scheduled.

Thread safety: the event loop writes a request's `SequenceInfo` into the shared `infos`
dict before `add_request` and reads the snapshots this scheduler publishes (`positions`,
`snapshot`), each replaced whole by one assignment; everything else is the manager thread's.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from transformers.generation.continuous_batching import scheduler as cb_scheduler
from transformers.generation.continuous_batching.requests import RequestState, RequestStatus

from loadmaster.model_pool.generation_order import (
    OUTPUT_TOKEN_COST,
    Entry,
    GenerationOrder,
    OrderPolicy,
    Transition,
)

__all__ = ["PriorityScheduler", "SchedulerSnapshot", "SequenceInfo", "install", "uninstall"]

_CHILD = "__child#"  # transformers names the forks of a request `<id>__child#<i>`
_STATUS_RANK = {RequestStatus.DECODING: 0, RequestStatus.PREFILLING: 1}
URGENT_HOLD_S = 1.0  # steps stay short this long after the last class-0 sequence was seen
URGENT_LOW_SHARE = 0.25  # of max_requests_per_batch: lower-class sequences per step meanwhile
_names = itertools.count()


@dataclass(frozen=True, slots=True)
class SequenceInfo:
    """What the scheduler needs to know of a request that the manager does not carry."""

    priority: int = 1
    tenant: str = ""
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    """Counts since load and the tenants' state, for metrics (`engine.stats()`)."""

    running: int = 0
    waiting: int = 0
    paused: int = 0  # waiting with their KV cache kept
    preemptions: int = 0
    yields: int = 0
    resumes: int = 0
    kv_kept: int = 0  # pauses that kept the KV cache until the sequence resumed or ended
    kv_recomputed: int = 0  # paused sequences whose cache was freed (they prefill again)
    urgent_steps: int = 0  # steps that carried only class-0 work for an urgent first token
    counter_gap: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)
    service: dict[str, float] = field(default_factory=dict)  # weighted, given here
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    output_tokens: dict[str, int] = field(default_factory=dict)


class PriorityScheduler(cb_scheduler.Scheduler):
    def __init__(
        self,
        cache: Any,
        safety_margin: float | None,
        max_requests_per_batch: int,
        *,
        policy: OrderPolicy,
        infos: MutableMapping[str, SequenceInfo],
        clock: Callable[[], float] = time.monotonic,
        resident: int = 0,
    ) -> None:
        self._policy = policy
        self._resident = max(resident, max_requests_per_batch)  # sequences holding their cache
        self._infos = infos
        self._clock = clock
        self._order = GenerationOrder(policy)
        self._paused: set[str] = set()  # request ids paused with their cache
        self._last_batch: set[str] = set()
        self._kv_recomputed = 0
        self._urgent_steps = 0
        self._steps = 0
        self._last_step: dict[str, int] = {}  # request id -> the step it last ran in
        self._urgent_seen = float("-inf")  # when a class-0 sequence last ran or waited
        self.remote_service: dict[str, float] | None = None  # set by the loop, applied at the next step
        self.positions: dict[str, int] = {}
        self.snapshot = SchedulerSnapshot()
        super().__init__(cache, 0.0 if safety_margin is None else safety_margin, max_requests_per_batch)

    def reset(self) -> None:
        super().reset()
        self._order = GenerationOrder(self._policy)
        self._paused = set()
        self._last_batch = set()

    # ---- membership (manager thread) ----------------------------------------------

    def add_waiting_request(self, state: RequestState) -> None:
        super().add_waiting_request(state)
        request_id = state.request_id
        if request_id in self._order:  # its cache was reclaimed (offloaded or reset): it waits again
            self._paused.discard(request_id)
            self._order.requeue(request_id, self._clock())
            return
        self._enter(request_id, state, self._clock())

    def _enter(self, request_id: str, state: RequestState, now: float) -> Entry:
        info = self._infos.get(request_id)
        if info is None and _CHILD in request_id:
            parent = self._order.entry(request_id.split(_CHILD, 1)[0])
            if parent is not None:
                info = SequenceInfo(parent.priority, parent.tenant, parent.weight)
        info = info or SequenceInfo()
        return self._order.add(
            request_id,
            priority=info.priority,
            tenant=info.tenant,
            weight=info.weight,
            prompt_tokens=len(state.initial_tokens),
            now=now,
        )

    def _sync(self, now: float) -> None:
        """Forget requests that finished or were cancelled; adopt forks the manager made."""
        for entry in list(self._order.running) + self._order.waiting:
            request_id = entry.request_id
            if request_id not in self.active_requests and request_id not in self.waiting_requests:
                self._order.remove(request_id)
                self._paused.discard(request_id)
                self._infos.pop(request_id, None)
                self._last_step.pop(request_id, None)
        for request_id, state in self.active_requests.items():
            if request_id not in self._order:  # a fork: running from birth
                entry = self._enter(request_id, state, now)
                entry.running = entry.started = True

    def has_pending_requests(self) -> bool:
        """Asked before each step; when nothing is left, the last ones leave the order now
        (no step would run to notice), so what is published says the engine is idle."""
        pending = super().has_pending_requests()
        if not pending and len(self._order):
            now = self._clock()
            self._sync(now)
            self._publish(now)
        return pending

    # ---- the step -----------------------------------------------------------------

    def schedule_batch(self, token_budget: int, cache_budget: int) -> tuple[list[Any] | None, bool, int, int]:
        now = self._clock()
        self._sync(now)
        remote, self.remote_service = self.remote_service, None
        if remote is not None:
            self._order.counters.set_remote(remote)
        plan = self._order.plan(
            capacity=self._resident,
            now=now,
            can_pause=True,
            can_start=not self.block_new_requests,
        )
        for transition, request_id in plan.transitions:
            if transition is Transition.PAUSE:
                if request_id in self.active_requests:
                    self._paused.add(request_id)
            else:
                self._paused.discard(request_id)
        scheduled, allocation_failed, fast_path, q_tokens, kv_read = self._schedule(
            token_budget, cache_budget
        )
        reclaimed = allocation_failed and self._reclaim_paused()
        if reclaimed and not scheduled:  # room was made: try once more this step
            scheduled, allocation_failed, fast_path, q_tokens, kv_read = self._schedule(
                token_budget, cache_budget
            )
        self._last_batch = {future.state.request_id for future in scheduled}
        for future in scheduled:
            if future.has_new_token:
                self._order.progressed(future.state.request_id, 1)
        self._publish(now)
        if not scheduled and allocation_failed and self.starved_requests:
            return None, fast_path, 0, 0  # the manager offloads starved requests, then asks again
        return scheduled, fast_path, q_tokens, kv_read

    def _schedule(self, token_budget: int, cache_budget: int) -> tuple[list[Any], bool, bool, int, int]:
        running = self._step_members(self._order.running)
        candidates = [
            state
            for entry in sorted(running, key=self._batch_key)
            if (state := self._state(entry.request_id)) is not None
        ]
        removed: set[str] = set()
        scheduled, failed, fast_path, q_tokens, kv_read = self._process_candidates(
            candidates, token_budget, cache_budget, removed
        )
        self._cleanup_waiting_queue(removed)
        self._steps += 1
        for future in scheduled:
            self._last_step[future.state.request_id] = self._steps
        return scheduled, failed, fast_path, q_tokens, kv_read

    def _step_members(self, running: list[Entry]) -> list[Entry]:
        """Who is in this step (at most `max_requests_per_batch` of the resident sequences):
        - a class-0 sequence waiting for its first token: class-0 work alone;
        - else every class-0 sequence, then the rest by class and, within a class, fairly
          between tenants: each place goes to the tenant whose counter, plus what this
          step already gives it, is lowest; within a tenant a new sequence (its prefill) first,
          then the one that waited longest for a step;
        - while urgent work is about (and `URGENT_HOLD_S` after), at most `URGENT_LOW_SHARE`
          of the places go to lower classes, so the next urgent arrival waits for a short step."""
        now = self._clock()
        budget = self.max_requests_per_batch
        urgent = [entry for entry in running if entry.admitted_class == 0]
        if urgent or any(entry.priority == 0 for entry in self._order.waiting):
            self._urgent_seen = now
        lower = [entry for entry in running if entry.admitted_class > 0]
        if lower and any(not self._has_first_token(entry) for entry in urgent):
            self._urgent_steps += 1
            return self._fair_share(urgent, budget)  # an urgent prefill: nothing else in its step
        if len(running) <= budget and (not lower or now - self._urgent_seen > URGENT_HOLD_S):
            return running
        chosen = self._fair_share(urgent, budget)
        room = budget - len(chosen)
        if now - self._urgent_seen <= URGENT_HOLD_S:
            room = min(room, max(1, int(self.max_requests_per_batch * URGENT_LOW_SHARE)))
        return chosen + self._fair_share(lower, room)

    def _fair_share(self, entries: list[Entry], places: int) -> list[Entry]:
        """`places` of `entries`: by class, then (with fairness) weighted fair between tenants."""
        if places <= 0:
            return []
        out: list[Entry] = []
        by_class: dict[int, list[Entry]] = {}
        for entry in entries:
            by_class.setdefault(entry.admitted_class, []).append(entry)
        for cls in sorted(by_class):
            members = sorted(by_class[cls], key=self._turn_key)
            room = places - len(out)
            if len(members) <= room:
                out += members
                continue
            if not self._policy.fairness:
                out += members[:room]
                break
            queues: dict[str, list[Entry]] = {}
            for entry in members:
                queues.setdefault(entry.tenant, []).append(entry)
            counters = self._order.counters
            projected = {tenant: counters.counter(tenant) for tenant in queues}
            for _ in range(room):
                tenant = min((t for t in queues if queues[t]), key=lambda t: projected[t])
                entry = queues[tenant].pop(0)
                out.append(entry)
                projected[tenant] += OUTPUT_TOKEN_COST / entry.weight
            break
        return out

    def _turn_key(self, entry: Entry) -> tuple[int, int, int]:
        """Within a tenant: a sequence still to be prefilled first, then the one that waited
        longest for a step, then arrival."""
        return (int(self._has_first_token(entry)), self._last_step.get(entry.request_id, 0), entry.arrival)

    def _batch_key(self, entry: Entry) -> tuple[int, int, int]:
        state = self._state(entry.request_id)
        rank = _STATUS_RANK.get(state.status, 2) if state is not None else 3
        return (entry.admitted_class, rank, entry.arrival)

    def _state(self, request_id: str) -> RequestState | None:
        return self.active_requests.get(request_id) or self.waiting_requests.get(request_id)

    def _has_first_token(self, entry: Entry) -> bool:
        state = self._state(entry.request_id)
        return state is None or state.status == RequestStatus.DECODING or state.generated_len() > 0

    def _reclaim_paused(self) -> bool:
        """Free the cache of the paused sequence that will resume last (not one still in a
        batch in flight): it waits again and prefills what it had when it resumes."""
        now = self._clock()
        candidates = [
            entry
            for request_id in self._paused
            if request_id not in self._last_batch
            and request_id in self.active_requests
            and (entry := self._order.entry(request_id)) is not None
        ]
        if not candidates:
            return False
        victim = max(candidates, key=lambda entry: self._order.key(entry, now))
        state = self.active_requests[victim.request_id]
        fresh = state.create_equivalent_initial_request()
        state._status = RequestStatus.FINISHED  # as transformers' own soft reset: no lifespan bookkeeping
        self.cache.free_blocks(victim.request_id)
        del self.active_requests[victim.request_id]
        self._paused.discard(victim.request_id)
        self.waiting_requests[victim.request_id] = fresh
        self.waiting_requests_order.append(victim.request_id)
        self._kv_recomputed += 1
        return True

    # ---- what the event loop reads ------------------------------------------------

    def _publish(self, now: float) -> None:
        order = self._order
        waiting = order.waiting
        # ahead of a stream without its first token: those that start before it, resident
        # ones that have not had their turn yet first, then the waiting ones in order
        unstarted = sorted(
            (entry for entry in order.running if not self._has_first_token(entry)),
            key=lambda entry: (entry.admitted_class, entry.arrival),
        )
        queue = unstarted + (order.ordered_waiting(now) if waiting else [])
        self.positions = {entry.request_id: index for index, entry in enumerate(queue)}
        totals = order.totals
        counters = order.counters
        self.snapshot = SchedulerSnapshot(
            running=len(order) - len(waiting),
            waiting=len(waiting),
            paused=len(self._paused),
            preemptions=totals.preemptions,
            yields=totals.yields,
            resumes=totals.resumes,
            kv_kept=max(0, totals.preemptions + totals.yields - self._kv_recomputed),
            kv_recomputed=self._kv_recomputed,
            urgent_steps=self._urgent_steps,
            counter_gap=counters.gap(),
            counters=counters.snapshot(),
            service=dict(counters.service),
            prompt_tokens=dict(counters.prompt_tokens),
            output_tokens=dict(counters.output_tokens),
        )


def install(policy: OrderPolicy, infos: MutableMapping[str, SequenceInfo], *, resident: int = 0) -> str:
    """Register a `PriorityScheduler` for one manager; returns the `scheduler_type` to give
    its `ContinuousBatchingConfig` (the manager builds its scheduler on its own thread from
    transformers' `SCHEDULER_MAPPING`). `uninstall` it when the manager stops."""
    name = f"loadmaster-priority-{next(_names)}"

    class Bound(PriorityScheduler):
        def __init__(self, cache: Any, safety_margin: float | None, max_requests_per_batch: int) -> None:
            super().__init__(
                cache,
                safety_margin,
                max_requests_per_batch,
                policy=policy,
                infos=infos,
                resident=max(resident, max_requests_per_batch),
            )

    cb_scheduler.SCHEDULER_MAPPING[name] = Bound
    return name


def uninstall(name: str) -> None:
    cb_scheduler.SCHEDULER_MAPPING.pop(name, None)
