"""Placement decisions over plain values: which worker gets a grant, which one loads a model.

Pure functions; the registry builds the candidates, the core acts on the answer.

Grants go to a worker holding the model READY with room under its per-model
`max_inflight`: the fewest grants in flight wins; ties are broken by power-of-two
choices (two tied workers drawn at random, the one whose own report shows less load
wins), which spreads load without herding when several schedulers or stale reports
are in play. A request with an `affinity_key` (the gateway's hash of a generation's prompt
prefix, docs/prefix-reuse.md) goes instead to the worker its key ranks first by rendezvous
hashing among those with room and at most `affinity_slack` grants more than the least busy:
requests sharing a prompt prefix meet on the worker whose KV cache holds it, a worker joining or
leaving moves only the keys it wins or held, and a hot prefix spills over rather than queue.
Placement never reorders requests: the strategy picks the request, this picks its worker. Loads go to the worker best able to take the model: enough free leased
memory first (most free first), else the fewest models it could not evict (busy, pinned
or with waiters), then the fewest models held; a worker where this model just failed to
load comes last. `free_mb` 0 means "not reported".
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from loadmaster.common.backends import GENERATIVE_BACKENDS
from loadmaster.common.rendezvous import affinity_rank
from loadmaster.scheduler.domain import PlacedWorker, SlotState, WorkerView

__all__ = [
    "GrantCandidate",
    "LoadCandidate",
    "affinity_rank",
    "generative_placements",
    "pick_batch_worker",
    "pick_grant_worker",
    "pick_load_worker",
]


@dataclass(slots=True)
class GrantCandidate:
    """A worker holding the model READY, with the grants it has not completed yet.

    Mutable: the registry keeps one per READY slot and counts grants in it in place."""

    worker_id: str
    inflight: int  # the scheduler's grants for this model not completed yet
    reported_load: int = 0  # requests in flight on the worker, all models, by its last report


@dataclass(frozen=True, slots=True)
class LoadCandidate:
    """A worker that has the model in its repository but does not hold it."""

    worker_id: str
    loaded: int  # models it holds READY or LOADING
    failed: bool  # its last attempt to load this model failed
    free_mb: int = 0  # free leased memory by its last report (0 = not reported)
    evictable: int = 0  # READY models with nothing in flight or waiting, not pinned


def pick_grant_worker(
    candidates: Iterable[GrantCandidate],
    *,
    max_inflight: int,
    rng: random.Random | None = None,
    affinity_key: str = "",
    affinity_slack: int | None = None,
) -> str | None:
    """The candidate with the fewest grants in flight, if it has room (under max_inflight); ties
    by power of two. With an `affinity_key`, the
    roomy candidate the key ranks first (`affinity_rank`) among those at most `affinity_slack`
    (default max(1, max_inflight // 4)) grants busier than the least busy."""
    best: GrantCandidate | None = None
    tied: list[GrantCandidate] | None = None  # a list only when candidates tie (this runs per grant)
    roomy: list[GrantCandidate] | None = [] if affinity_key else None
    for candidate in candidates:
        inflight = candidate.inflight
        if inflight >= max_inflight:
            continue  # no room
        if roomy is not None:
            roomy.append(candidate)
        if best is None or inflight < best.inflight:
            best = candidate
            tied = None
        elif inflight == best.inflight:
            if tied is None:
                tied = [best]
            tied.append(candidate)
    if best is None:
        return None
    if roomy is not None and len(roomy) > 1:
        slack = max(1, max_inflight // 4) if affinity_slack is None else affinity_slack
        limit = best.inflight + slack
        return max(
            (c for c in roomy if c.inflight <= limit), key=lambda c: affinity_rank(affinity_key, c.worker_id)
        ).worker_id
    if tied is None:
        return best.worker_id
    a, b = (rng or random).sample(tied, 2)
    return min((a, b), key=lambda c: (c.reported_load, c.worker_id)).worker_id


def pick_batch_worker(candidates: Iterable[GrantCandidate], *, max_inflight: int) -> tuple[str, int] | None:
    """The candidate with the most room for a group (worker id, free slots), if any has room."""
    best: GrantCandidate | None = None
    for candidate in candidates:
        if candidate.inflight >= max_inflight:
            continue
        if best is None or (candidate.inflight, candidate.worker_id) < (best.inflight, best.worker_id):
            best = candidate
    return (best.worker_id, max_inflight - best.inflight) if best is not None else None


def pick_load_worker(candidates: Iterable[LoadCandidate], *, vram_mb: int | None = None) -> str | None:
    """The candidate best able to take the model (see the module docstring)."""

    def rank(c: LoadCandidate) -> tuple[object, ...]:
        fits = c.free_mb > 0 and (vram_mb is None or c.free_mb >= vram_mb)
        committed = c.loaded - c.evictable  # models it holds that cannot make room
        return (c.failed, not fits, -c.free_mb if fits else 0, committed, c.loaded, c.worker_id)

    ranked = sorted(candidates, key=rank)
    return ranked[0].worker_id if ranked else None


def generative_placements(workers: Iterable[WorkerView]) -> dict[str, tuple[PlacedWorker, ...]]:
    """Per generative model, the workers that hold it READY (by worker id): where gateways
    may send its generations themselves (docs/generation-scheduling.md)."""
    out: dict[str, list[PlacedWorker]] = {}
    for worker in sorted(workers, key=lambda w: w.hello.worker_id):
        for slot in worker.slots:
            if slot.state is SlotState.READY and slot.backend in GENERATIVE_BACKENDS:
                placed = PlacedWorker(worker.hello.worker_id, worker.hello.data_endpoint, slot.generation)
                out.setdefault(slot.model_id, []).append(placed)
    return {model_id: tuple(placed) for model_id, placed in out.items()}
