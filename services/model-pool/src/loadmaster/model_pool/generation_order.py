"""Which generation runs next: priority class first, then token fairness between tenants.

Pure decisions over plain values, with the time passed in (docs/generation-scheduling.md).
Two drivers use it, so one policy orders every generative engine:
- the transformers engine's scheduler inside the continuous-batching manager
  (`engines/_cb_scheduler.py`), once per engine step: it may pause a running sequence and
  keep its KV cache, so it preempts and time-slices;
- the worker's `Sequencer` (`sequencing.py`) for engines that order nothing themselves
  (engine processes): it admits at most the engine's `max_sequences` and never pauses.

The order of waiting generations is the key (class, counter, arrival):
- class: the request's priority (0 is the most urgent), one class better for every
  `promote_after_s` it has waited (starvation is bounded by promotion, never by the age of
  requests in milliseconds: a lower class never overtakes a higher one for being older);
- counter: its tenant's virtual token counter (Sheng et al., "Fairness in Serving Large
  Language Models", OSDI 2024): prompt tokens x 1 charged when it first starts, each output
  token x 2, both divided by the tenant's weight. A tenant that becomes backlogged (had
  nothing waiting or running here) is lifted to the lowest counter among the backlogged
  tenants, else to the highest counter seen, so idle time banks no credit. Fairness never
  overrides priority; with `fairness` off the counter is left out (arrival order);
- arrival: first come, first served among equals (a paused sequence keeps its arrival).

Running sequences give way in two cases, both counted:
- preemption: the best waiting generation is of class 0 and every place is held by
  lower-class work: the lowest-class running sequence (the newest among equals) pauses;
- timeslice (`timeslice_tokens` > 0): a running sequence that produced that many tokens
  since it (re)started yields its place to waiting work of a better class.
A paused sequence waits again under its own key; `plan` says whether it resumes or starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = [
    "OUTPUT_TOKEN_COST",
    "PROMPT_TOKEN_COST",
    "Entry",
    "GenerationOrder",
    "OrderPolicy",
    "Plan",
    "TenantCounters",
    "Transition",
]

PROMPT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0


@dataclass(frozen=True, slots=True)
class OrderPolicy:
    """The `generation:` settings (libs/common config.py `GenerationSettings`)."""

    fairness: bool = True
    timeslice_tokens: int = 0  # 0 = off
    promote_after_s: float = 10.0


class TenantCounters:
    """Virtual token counters, one per tenant, and the raw service each tenant got."""

    def __init__(self) -> None:
        self._counter: dict[str, float] = {}
        self._backlog: dict[str, int] = {}  # tenant -> generations waiting or running here
        self._remote: dict[str, float] = {}  # weighted service the tenant got on other workers
        self.service: dict[str, float] = {}  # weighted service given here (what other workers hear)
        self.prompt_tokens: dict[str, int] = {}
        self.output_tokens: dict[str, int] = {}

    def counter(self, tenant: str) -> float:
        return self._counter.get(tenant, 0.0) + self._remote.get(tenant, 0.0)

    @property
    def backlogged(self) -> list[str]:
        return [tenant for tenant, count in self._backlog.items() if count > 0]

    def joined(self, tenant: str) -> None:
        """A generation of `tenant` arrived; lift the tenant if it was not backlogged."""
        count = self._backlog.get(tenant, 0)
        if count == 0:
            others = [self.counter(t) for t in self.backlogged]
            floor = min(others) if others else max((self.counter(t) for t in self._counter), default=0.0)
            lift = floor - self.counter(tenant)
            if lift > 0:
                self._counter[tenant] = self._counter.get(tenant, 0.0) + lift
            self._counter.setdefault(tenant, 0.0)
        self._backlog[tenant] = count + 1

    def left(self, tenant: str) -> None:
        count = self._backlog.get(tenant, 0)
        if count <= 1:
            self._backlog.pop(tenant, None)
        else:
            self._backlog[tenant] = count - 1

    def charge_prompt(self, tenant: str, tokens: int, weight: float) -> None:
        self.prompt_tokens[tenant] = self.prompt_tokens.get(tenant, 0) + tokens
        self._charge(tenant, tokens * PROMPT_TOKEN_COST / weight)

    def charge_output(self, tenant: str, tokens: int, weight: float) -> None:
        self.output_tokens[tenant] = self.output_tokens.get(tenant, 0) + tokens
        self._charge(tenant, tokens * OUTPUT_TOKEN_COST / weight)

    def _charge(self, tenant: str, amount: float) -> None:
        if amount <= 0:
            return
        self._counter[tenant] = self._counter.get(tenant, 0.0) + amount
        self.service[tenant] = self.service.get(tenant, 0.0) + amount

    def set_remote(self, service: dict[str, float]) -> None:
        """The weighted service each tenant got from this model on other workers (so a tenant
        cannot gain by being spread over workers)."""
        self._remote = dict(service)

    def gap(self) -> float:
        """The largest difference between the counters of backlogged tenants (0 with fewer than two)."""
        counters = [self.counter(tenant) for tenant in self.backlogged]
        return max(counters) - min(counters) if len(counters) > 1 else 0.0

    def snapshot(self) -> dict[str, float]:
        return {tenant: self.counter(tenant) for tenant in self._counter}


class Transition(StrEnum):
    START = "start"  # first time in the engine: prefill
    RESUME = "resume"  # was paused: continues where it stopped
    PAUSE = "pause"  # leaves its place (preempted or yielded)


@dataclass(slots=True, eq=False)
class Entry:
    request_id: str
    priority: int
    tenant: str
    weight: float
    arrival: int  # arrival order (ties among equal keys go to the first)
    prompt_tokens: int
    waiting_since: float
    running: bool = False
    started: bool = False  # has run at least once (prompt charged)
    admitted_class: int = 0  # its class when it last started (promotion applies while waiting)
    tokens_since_start: int = 0

    def waiting_class(self, now: float, promote_after_s: float) -> int:
        if self.priority == 0:
            return 0
        waited = max(0.0, now - self.waiting_since)
        return max(0, self.priority - int(waited // promote_after_s))


@dataclass(slots=True)
class Plan:
    """What to do before the next engine step, in order: pauses first, then starts/resumes."""

    transitions: list[tuple[Transition, str]] = field(default_factory=list)
    preempted: int = 0
    yielded: int = 0

    def __bool__(self) -> bool:
        return bool(self.transitions)


@dataclass(slots=True)
class _Totals:
    preemptions: int = 0
    yields: int = 0
    resumes: int = 0


class GenerationOrder:
    """The generations of one model on one worker: who runs, who waits, in which order."""

    def __init__(self, policy: OrderPolicy | None = None) -> None:
        self.policy = policy or OrderPolicy()
        self.counters = TenantCounters()
        self._entries: dict[str, Entry] = {}
        self._arrivals = 0
        self.totals = _Totals()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, request_id: str) -> Entry | None:
        return self._entries.get(request_id)

    @property
    def running(self) -> list[Entry]:
        return [entry for entry in self._entries.values() if entry.running]

    @property
    def waiting(self) -> list[Entry]:
        return [entry for entry in self._entries.values() if not entry.running]

    # ---- membership ---------------------------------------------------------------

    def add(
        self,
        request_id: str,
        *,
        priority: int,
        tenant: str,
        weight: float,
        prompt_tokens: int,
        now: float,
    ) -> Entry:
        weight = weight if weight > 0 and math.isfinite(weight) else 1.0
        entry = Entry(
            request_id,
            max(0, int(priority)),
            tenant,
            weight,
            self._arrivals,
            max(0, int(prompt_tokens)),
            waiting_since=now,
        )
        self._arrivals += 1
        self._entries[request_id] = entry
        self.counters.joined(tenant)
        return entry

    def remove(self, request_id: str) -> Entry | None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self.counters.left(entry.tenant)
        return entry

    def requeue(self, request_id: str, now: float) -> None:
        """A running generation lost its place outside `plan` (its KV cache was reclaimed):
        it waits again and will start over (its prompt is not charged twice)."""
        entry = self._entries.get(request_id)
        if entry is not None and entry.running:
            entry.running = False
            entry.waiting_since = now

    # ---- progress -----------------------------------------------------------------

    def progressed(self, request_id: str, tokens: int) -> None:
        """A running generation produced `tokens` output tokens: charge its tenant."""
        entry = self._entries.get(request_id)
        if entry is None or tokens <= 0:
            return
        entry.tokens_since_start += tokens
        self.counters.charge_output(entry.tenant, tokens, entry.weight)

    # ---- ordering -----------------------------------------------------------------

    def key(self, entry: Entry, now: float) -> tuple[int, float, int]:
        cls = entry.admitted_class if entry.running else entry.waiting_class(now, self.policy.promote_after_s)
        counter = self.counters.counter(entry.tenant) if self.policy.fairness else 0.0
        return (cls, counter, entry.arrival)

    def ordered_waiting(self, now: float) -> list[Entry]:
        return sorted(self.waiting, key=lambda entry: self.key(entry, now))

    def positions(self, now: float) -> dict[str, int]:
        """Waiting generation -> how many generations are ahead of it in the queue."""
        return {entry.request_id: index for index, entry in enumerate(self.ordered_waiting(now))}

    def plan(self, *, capacity: int, now: float, can_pause: bool, can_start: bool = True) -> Plan:
        """Fill `capacity` running places from the waiting generations in order; with
        `can_pause`, pause running ones for better-class work (preemption, timeslices).
        `can_start` False admits only paused ones (the engine takes no new work just now)."""
        plan = Plan()
        waiting = self.ordered_waiting(now)
        running = self.running
        for candidate in waiting:
            if not can_start and not candidate.started:
                continue
            cls = self.key(candidate, now)[0]
            if len(running) >= capacity:
                victim = self._victim(running, cls) if can_pause else None
                if victim is None:
                    break  # the candidates after it are of its class or worse: none can do better
                running.remove(victim)
                self._pause(victim, now, plan, preempted=cls == 0)
            self._start(candidate, cls, plan)
            running.append(candidate)
        return plan

    def _victim(self, running: list[Entry], cls: int) -> Entry | None:
        """The running generation that gives way to waiting work of class `cls`, if any."""
        worse = [entry for entry in running if entry.admitted_class > cls]
        if not worse:
            return None
        if cls != 0:  # only a finished timeslice lets better non-urgent work in
            worse = [entry for entry in worse if self._timeslice_over(entry)]
            if not worse:
                return None
        return max(worse, key=lambda entry: (entry.admitted_class, entry.arrival))

    def _timeslice_over(self, entry: Entry) -> bool:
        slice_tokens = self.policy.timeslice_tokens
        return slice_tokens > 0 and entry.tokens_since_start >= slice_tokens

    def _pause(self, entry: Entry, now: float, plan: Plan, *, preempted: bool) -> None:
        entry.running = False
        entry.waiting_since = now
        plan.transitions.append((Transition.PAUSE, entry.request_id))
        if preempted:
            plan.preempted += 1
            self.totals.preemptions += 1
        else:
            plan.yielded += 1
            self.totals.yields += 1

    def _start(self, entry: Entry, cls: int, plan: Plan) -> None:
        entry.running = True
        entry.admitted_class = cls
        entry.tokens_since_start = 0
        if entry.started:
            self.totals.resumes += 1
            plan.transitions.append((Transition.RESUME, entry.request_id))
            return
        entry.started = True
        self.counters.charge_prompt(entry.tenant, entry.prompt_tokens, entry.weight)
        plan.transitions.append((Transition.START, entry.request_id))
