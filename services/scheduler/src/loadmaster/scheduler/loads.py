"""Load commands in flight: which worker was told to load which model, and how it turned out;
and the VRAM gate: models whose last load was refused for want of GPU memory.

Pure bookkeeping over slot reports. A worker bumps a slot's generation per load, so a
report tells one load attempt's outcome from another's even when LOADING went unseen.

A load refused for memory (the worker's error starts with `MEMORY_ERROR`, written by
model_pool.eviction.no_room_message) does not fail its waiters: the model is *gated*. Its
requests stay queued, and the load is commanded again at `retry_at` or as soon as a worker
frees memory, until it succeeds, the waiters' deadlines pass, or no one waits any more
(docs/vram-gate.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from loadmaster.scheduler.domain import HOLDING_STATES, SlotState, SlotStatus

__all__ = ["MEMORY_ERROR", "LoadTracker", "MemoryGate", "freed_memory", "is_memory_error", "load_outlasts"]

# How a worker's load error says the model did not fit in GPU memory (and nothing could be
# evicted for it): model_pool.eviction.no_room_message starts with these words.
MEMORY_ERROR = "no GPU memory for model"


def is_memory_error(error: str) -> bool:
    """The load found no memory now, and memory freed later could make room (not a model that
    can never fit: the broker says so, and its waiters are refused at once)."""
    return error.startswith(MEMORY_ERROR) and "can never fit" not in error


def load_outlasts(
    model_id: str, *, load_ms: float, commanded_at: float | None, ttl_ms: float, now: float
) -> str | None:
    """Load time counts against the deadline: when a model that is not READY needs longer to
    be ready (its last load took `load_ms`; a load commanded at `commanded_at` is on its way)
    than a request may wait (`ttl_ms`), the message to refuse it with now; else None."""
    if load_ms <= 0.0:
        return None  # never loaded here: no estimate
    left_ms = load_ms - (now - commanded_at) * 1000.0 if commanded_at is not None else load_ms
    if left_ms <= ttl_ms:
        return None
    loading = "is loading" if commanded_at is not None else "is not loaded"
    return (
        f"model {model_id!r} {loading} and needs about {left_ms:.0f} ms more to be ready "
        f"(its last load took {load_ms:.0f} ms): more than this request's {ttl_ms:.0f} ms deadline"
    )


def freed_memory(
    previous: Mapping[str, SlotStatus], current: Mapping[str, SlotStatus], failures: Mapping[str, str]
) -> bool:
    """A worker's report shows a model that held memory back at IDLE (an unload or an eviction;
    not a load that just failed: that one never had the memory it wanted)."""
    for model_id, before in previous.items():
        if before.state is SlotState.IDLE or model_id in failures:
            continue
        after = current.get(model_id)
        if after is None or after.state is SlotState.IDLE:
            return True
    return False


@dataclass(frozen=True, slots=True)
class MemoryGate:
    """A model whose waiters wait for GPU memory: since when, why, and when to try again."""

    since: float  # monotonic: the first refusal of this wait
    reason: str  # the worker's last refusal
    retry_at: float  # monotonic: when the load is commanded again


@dataclass(frozen=True, slots=True)
class _PendingLoad:
    """A load command sent and not yet answered by a LOADING/READY report or a failure."""

    worker_id: str
    baseline: tuple[SlotState, str, int]  # the slot's (state, error, generation) when commanded
    at: float = 0.0  # monotonic: when it was commanded


def _slot_key(slot: SlotStatus | None) -> tuple[SlotState, str, int]:
    if slot is None:
        return (SlotState.IDLE, "", 0)
    return (slot.state, slot.error, slot.generation)


class LoadTracker:
    def __init__(self) -> None:
        self._pending: dict[str, _PendingLoad] = {}
        self._gates: dict[str, MemoryGate] = {}

    def __contains__(self, model_id: str) -> bool:
        return model_id in self._pending

    def commanded(self, model_id: str, worker_id: str, slot: SlotStatus | None, *, now: float = 0.0) -> None:
        self._pending[model_id] = _PendingLoad(worker_id, _slot_key(slot), now)

    def commanded_at(self, model_id: str) -> float | None:
        """When the load of `model_id` now in flight was commanded (None: none is)."""
        pending = self._pending.get(model_id)
        return pending.at if pending is not None else None

    # ---- the VRAM gate --------------------------------------------------------------

    def gate(self, model_id: str, reason: str, *, now: float, retry_s: float) -> MemoryGate:
        """A load of `model_id` was refused for memory: its waiters wait; try again in `retry_s`."""
        previous = self._gates.get(model_id)
        since = previous.since if previous is not None else now
        gate = self._gates[model_id] = MemoryGate(since, reason, now + retry_s)
        return gate

    @property
    def gating(self) -> bool:
        """Some model waits behind the VRAM gate (a cheap check for the dispatch path)."""
        return bool(self._gates)

    def gated(self, model_id: str) -> MemoryGate | None:
        return self._gates.get(model_id)

    def ungate(self, model_id: str) -> None:
        self._gates.pop(model_id, None)

    def blocked(self, model_id: str, now: float) -> bool:
        """The model waits for memory and its next attempt is not due yet."""
        gate = self._gates.get(model_id)
        return gate is not None and now < gate.retry_at

    def attempting(self, model_id: str) -> None:
        """The gated load was commanded again: no retry until its outcome is known."""
        gate = self._gates.get(model_id)
        if gate is not None:
            self._gates[model_id] = MemoryGate(gate.since, gate.reason, math.inf)

    def retry_all(self, now: float) -> None:
        """Memory was freed somewhere: every gated load may try again now."""
        for model_id, gate in self._gates.items():
            if now < gate.retry_at < math.inf:
                self._gates[model_id] = MemoryGate(gate.since, gate.reason, now)

    def next_retry(self) -> float | None:
        return min((g.retry_at for g in self._gates.values() if g.retry_at < math.inf), default=None)

    def due(self, now: float) -> list[str]:
        return [model_id for model_id, gate in self._gates.items() if gate.retry_at <= now]

    def forget_worker(self, worker_id: str) -> None:
        for model_id, pending in list(self._pending.items()):
            if pending.worker_id == worker_id:
                del self._pending[model_id]

    def observe(
        self, worker_id: str, previous: Mapping[str, SlotStatus], current: Mapping[str, SlotStatus]
    ) -> dict[str, str]:
        """A worker's new report: settle its pending loads; return model -> error of failed loads."""
        failures: dict[str, str] = {}
        for model_id, pending in list(self._pending.items()):
            if pending.worker_id != worker_id:
                continue
            seen = _slot_key(current.get(model_id))
            state, error, _ = seen
            if state in HOLDING_STATES:
                del self._pending[model_id]
            elif error and seen != pending.baseline:  # a new failure, even if LOADING went unseen
                del self._pending[model_id]
                failures[model_id] = error
        for model_id, slot in current.items():
            before = previous.get(model_id)
            was_loading = before is not None and before.state is SlotState.LOADING
            if was_loading and slot.error and slot.state not in HOLDING_STATES:
                failures.setdefault(model_id, slot.error)
        return failures
