"""Eviction policy over plain values: which resident model makes room, and which are idle too long.

    choice = choose_victim(residents, incoming=Incoming(model_id, priority, gpus), now=clock.monotonic())
    choice.victim      the model to unload next (None when nothing may go now)
    choice.waiting     models worth waiting for: requests in flight, loaded < min_resident_s ago,
                       still loading (evictable once READY), or draining/unloading (memory on its way back)
    choice.refused     model -> why it never goes for this load (pinned, higher priority)

Rules, in order: only READY models; never a pinned one; never one with a request in
flight; never one whose priority is above the incoming model's; never one loaded less
than its `min_resident_s` ago (anti-thrash). A model that holds a lease but is not READY
(`state` "loading" or "unloading") is never a victim: the load waits for it to settle.
Among the rest: lowest priority first,
then least recently used, then the larger model. The pool evicts one victim at a time
and tries its lease again, until the lease fits.

The warm bump (`WarmBump`, docs/vram-gate.md): a model of the incoming model's priority
that is in use (a request in flight, or one finished less than `idle_s` ago: its next
request is on its way) is served first; the load waits for it until `until`. From then
on, models in use of the incoming priority or below are victims even with requests in
flight: their unload drains them first, so nothing in flight is cut, and the cold model's
requests never starve.

`plan_evictions` looks at the whole load first: with the broker's free memory per GPU it
picks the victims that together make room on one GPU, and none at all when even every
evictable model could not (say another holder has the rest of the card): a load that
cannot fit then fails without unloading anything.

`idle_models` / `next_idle_deadline` implement `keep_alive_s`. Pure functions, no clock
of their own: `now` is the pool's monotonic time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "EvictionChoice",
    "EvictionCounters",
    "EvictionPlan",
    "Incoming",
    "Resident",
    "WarmBump",
    "choose_victim",
    "idle_models",
    "next_idle_deadline",
    "no_room_message",
    "plan_evictions",
]


@dataclass(frozen=True, slots=True)
class Resident:
    """A model this worker holds READY, as the policy sees it."""

    model_id: str
    vram_mb: int
    priority: int
    pinned: bool
    inflight: int
    last_used: float  # monotonic seconds of the last finished request (or of the load)
    loaded_at: float  # monotonic seconds when it became READY
    gpus: tuple[int, ...] = ()
    min_resident_s: float = 0.0
    keep_alive_s: float | None = None
    state: Literal["ready", "loading", "unloading"] = "ready"
    mb_per_gpu: tuple[tuple[int, int], ...] = ()  # its lease, per GPU (() = vram_mb on each of `gpus`)

    def frees_on(self, gpu: int) -> int:
        """MB its unload gives back on `gpu`."""
        for index, mb in self.mb_per_gpu:
            if index == gpu:
                return mb
        if self.mb_per_gpu:
            return 0
        return self.vram_mb if not self.gpus or gpu in self.gpus else 0


@dataclass(frozen=True, slots=True)
class Incoming:
    model_id: str
    priority: int
    gpus: tuple[int, ...] = ()  # the GPUs it must go on; () = any


@dataclass(frozen=True, slots=True)
class WarmBump:
    """Until monotonic `until`, a load does not evict models in use of its own priority
    (in use: a request in flight, or one finished less than `idle_s` ago)."""

    until: float
    idle_s: float

    def in_use(self, r: Resident, now: float) -> bool:
        return r.inflight > 0 or now - r.last_used < self.idle_s


@dataclass(frozen=True, slots=True)
class EvictionChoice:
    victim: str | None
    waiting: tuple[str, ...] = ()
    refused: dict[str, str] = field(default_factory=dict)

    @property
    def worth_waiting(self) -> bool:
        return self.victim is None and bool(self.waiting)


def choose_victim(
    residents: Iterable[Resident], *, incoming: Incoming, now: float, bump: WarmBump | None = None
) -> EvictionChoice:
    eligible: list[Resident] = []
    waiting: list[str] = []
    refused: dict[str, str] = {}
    for r in residents:
        if r.model_id == incoming.model_id:
            continue
        if incoming.gpus and r.gpus and not set(r.gpus) & set(incoming.gpus):
            continue  # frees nothing where the incoming model goes
        if r.state == "unloading":
            waiting.append(r.model_id)  # its memory comes back without anyone's say
        elif r.pinned:
            refused[r.model_id] = "pinned"
        elif r.priority > incoming.priority:
            refused[r.model_id] = f"priority {r.priority} > {incoming.priority}"
        elif r.state == "loading" or now - r.loaded_at < r.min_resident_s:
            waiting.append(r.model_id)
        elif (
            bump is not None and now < bump.until and r.priority == incoming.priority and bump.in_use(r, now)
        ):
            waiting.append(r.model_id)  # warm and in demand: its requests go first, until the bound
        elif r.inflight > 0 and (bump is None or now < bump.until):
            waiting.append(r.model_id)
        else:
            eligible.append(r)
    eligible.sort(key=lambda r: (r.priority, r.last_used, -r.vram_mb, r.model_id))
    victim = eligible[0].model_id if eligible else None
    return EvictionChoice(victim=victim, waiting=tuple(sorted(waiting)), refused=refused)


@dataclass(frozen=True, slots=True)
class EvictionPlan:
    """What a load that does not fit should do: evict `victims` (in order: then it fits on
    `gpu`), wait for `choice.waiting` (they would make room once settled), or neither."""

    victims: tuple[str, ...]
    choice: EvictionChoice
    gpu: int | None = None
    could_fit_after_waiting: bool = False

    @property
    def worth_waiting(self) -> bool:
        return not self.victims and self.could_fit_after_waiting

    @property
    def fits_now(self) -> bool:
        """The broker's free memory already fits the load (it changed since the refusal)."""
        return not self.victims and self.gpu is not None


def plan_evictions(
    residents: Sequence[Resident],
    *,
    incoming: Incoming,
    mb: int,
    free_mb: Mapping[int, int],
    now: float,
    split: bool = False,
    bump: WarmBump | None = None,
) -> EvictionPlan:
    """The fewest victims (in `choose_victim`'s order) that make room for `mb` on one GPU,
    given the broker's `free_mb` per GPU; with `split` (the load may spread over the GPUs),
    else those that make room over all GPUs together; no victims when no set of evictions could."""
    choice = choose_victim(residents, incoming=incoming, now=now, bump=bump)
    by_id = {r.model_id: r for r in residents}
    blocked = set(choice.waiting) | set(choice.refused) | {incoming.model_id}
    eligible = sorted(
        (r for r in residents if r.model_id not in blocked and r.state == "ready"),
        key=lambda r: (r.priority, r.last_used, -r.vram_mb, r.model_id),
    )
    gpus = incoming.gpus or tuple(sorted(free_mb))
    best: tuple[int, int, tuple[str, ...]] | None = None  # (victims, gpu order, victims)
    could_wait = False
    for order, gpu in enumerate(gpus):
        free = free_mb.get(gpu, 0)
        victims: list[str] = []
        for r in eligible:
            if free >= mb:
                break
            if r.frees_on(gpu):
                free += r.frees_on(gpu)
                victims.append(r.model_id)
        if free >= mb:
            if best is None or len(victims) < best[0]:
                best = (len(victims), order, tuple(victims))
        elif free + sum(by_id[m].frees_on(gpu) for m in choice.waiting if m in by_id) >= mb:
            could_wait = True
    if best is not None:
        return EvictionPlan(victims=best[2], choice=choice, gpu=gpus[best[1]])
    if split and not incoming.gpus:
        total, spread = sum(free_mb.values()), []
        for r in eligible:
            if total >= mb:
                break
            freed = sum(r.frees_on(gpu) for gpu in free_mb)
            if freed:
                total += freed
                spread.append(r.model_id)
        if total >= mb:  # no victims: it fits split as it is (the caller tries that)
            return EvictionPlan(victims=tuple(spread), choice=choice)
        waiting_mb = sum(by_id[m].frees_on(gpu) for m in choice.waiting if m in by_id for gpu in free_mb)
        could_wait = could_wait or total + waiting_mb >= mb
    return EvictionPlan(victims=(), choice=choice, could_fit_after_waiting=could_wait)


def no_room_message(model_id: str, mb: int, choice: EvictionChoice, residents: Sequence[Resident]) -> str:
    """The error for a load that cannot get room, naming what holds the memory and why it stays."""
    reasons = [f"{m} ({why})" for m, why in sorted(choice.refused.items())]
    busy = {r.model_id: r for r in residents}
    for m in choice.waiting:
        r = busy.get(m)
        why: str
        if r is not None and r.state != "ready":
            why = r.state
        else:
            why = "busy" if r is not None and r.inflight else "recently loaded"
        reasons.append(f"{m} ({why})")
    held = ", ".join(reasons) if reasons else "no evictable model"
    return f"no GPU memory for model '{model_id}' ({mb} MB) and nothing can be evicted: {held}"


def idle_models(residents: Iterable[Resident], *, now: float) -> list[str]:
    """READY models idle for at least their `keep_alive_s` (never pinned, never busy)."""
    return sorted(
        r.model_id
        for r in residents
        if r.state == "ready"
        and r.keep_alive_s is not None
        and not r.pinned
        and r.inflight == 0
        and now - r.last_used >= r.keep_alive_s
    )


def next_idle_deadline(residents: Iterable[Resident]) -> float | None:
    """When the next idle model reaches its keep-alive (monotonic), if any could."""
    deadlines = [
        r.last_used + r.keep_alive_s
        for r in residents
        if r.state == "ready" and r.keep_alive_s is not None and not r.pinned and r.inflight == 0
    ]
    return min(deadlines) if deadlines else None


@dataclass(slots=True)
class EvictionCounters:
    """Evictions by (model, reason) and reloads (loads of a model evicted before)."""

    evictions: dict[tuple[str, str], int] = field(default_factory=dict)
    reloads: dict[str, int] = field(default_factory=dict)
    _evicted: set[str] = field(default_factory=set)

    def evicted(self, model_id: str, reason: str) -> None:
        key = (model_id, reason)
        self.evictions[key] = self.evictions.get(key, 0) + 1
        self._evicted.add(model_id)

    def loaded(self, model_id: str) -> bool:
        """Count a load; True when it is a reload of an evicted model."""
        if model_id in self._evicted:
            self._evicted.discard(model_id)
            self.reloads[model_id] = self.reloads.get(model_id, 0) + 1
            return True
        return False

    def of(self, model_id: str) -> int:
        return sum(count for (m, _), count in self.evictions.items() if m == model_id)

    def by_reason(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (_, reason), count in self.evictions.items():
            out[reason] = out.get(reason, 0) + count
        return out
