"""Placement decisions over plain values: which worker gets a grant, which one loads a model.

Pure functions; the registry builds the candidates, the core acts on the answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["GrantCandidate", "LoadCandidate", "pick_grant_worker", "pick_load_worker"]


@dataclass(frozen=True, slots=True)
class GrantCandidate:
    """A worker holding the model READY, with the grants it has not completed yet."""

    worker_id: str
    inflight: int


@dataclass(frozen=True, slots=True)
class LoadCandidate:
    """A worker that has the model in its repository but does not hold it."""

    worker_id: str
    loaded: int  # models it holds READY or LOADING
    failed: bool  # its last attempt to load this model failed


def pick_grant_worker(candidates: Iterable[GrantCandidate], *, max_inflight: int) -> str | None:
    """The candidate with the fewest grants in flight, if it has room for one more."""
    best: GrantCandidate | None = None
    for candidate in candidates:
        if candidate.inflight >= max_inflight:
            continue
        if best is None or (candidate.inflight, candidate.worker_id) < (best.inflight, best.worker_id):
            best = candidate
    return best.worker_id if best is not None else None


def pick_load_worker(candidates: Iterable[LoadCandidate]) -> str | None:
    """The least loaded candidate, avoiding one where this model just failed to load."""
    ranked = sorted(candidates, key=lambda c: (c.failed, c.loaded, c.worker_id))
    return ranked[0].worker_id if ranked else None
