"""Load commands in flight: which worker was told to load which model, and how it turned out.

Pure bookkeeping over slot reports. A worker bumps a slot's generation per load, so a
report tells one load attempt's outcome from another's even when LOADING went unseen.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from loadmaster.scheduler.domain import HOLDING_STATES, SlotState, SlotStatus

__all__ = ["LoadTracker"]


@dataclass(frozen=True, slots=True)
class _PendingLoad:
    """A LoadCommand sent and not yet answered by a LOADING/READY report or a failure."""

    worker_id: str
    baseline: tuple[SlotState, str, int]  # the slot's (state, error, generation) when commanded


def _slot_key(slot: SlotStatus | None) -> tuple[SlotState, str, int]:
    if slot is None:
        return (SlotState.IDLE, "", 0)
    return (slot.state, slot.error, slot.generation)


class LoadTracker:
    def __init__(self) -> None:
        self._pending: dict[str, _PendingLoad] = {}

    def __contains__(self, model_id: str) -> bool:
        return model_id in self._pending

    def commanded(self, model_id: str, worker_id: str, slot: SlotStatus | None) -> None:
        self._pending[model_id] = _PendingLoad(worker_id, _slot_key(slot))

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
