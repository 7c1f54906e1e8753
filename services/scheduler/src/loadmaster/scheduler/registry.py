"""Connected model-pool workers: what they can load, their slots as last reported, and the
grants the scheduler has handed them that are not completed yet.

Plain bookkeeping; the worker's own `inflight` in a report lags, so placement counts
the scheduler's grants instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from loadmaster.scheduler.domain import HOLDING_STATES, RequestKey, SlotState, SlotStatus, WorkerHello
from loadmaster.scheduler.placement import GrantCandidate, LoadCandidate

__all__ = ["WorkerRecord", "WorkerRegistry"]


@dataclass(slots=True)
class WorkerRecord:
    hello: WorkerHello
    repository: frozenset[str]
    slots: dict[str, SlotStatus] = field(default_factory=dict)
    granted: dict[RequestKey, str] = field(default_factory=dict)  # request -> model
    inflight: dict[str, int] = field(default_factory=dict)  # model -> grants not completed

    @property
    def worker_id(self) -> str:
        return self.hello.worker_id

    def holding(self) -> int:
        return sum(1 for slot in self.slots.values() if slot.state in HOLDING_STATES)

    def state_of(self, model_id: str) -> SlotState:
        slot = self.slots.get(model_id)
        return slot.state if slot is not None else SlotState.IDLE


class WorkerRegistry:
    def __init__(self) -> None:
        self._workers: dict[str, WorkerRecord] = {}

    def __len__(self) -> int:
        return len(self._workers)

    def __iter__(self) -> Iterator[WorkerRecord]:
        return iter(list(self._workers.values()))

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._workers.get(worker_id)

    def add(self, hello: WorkerHello) -> WorkerRecord:
        if hello.worker_id in self._workers:
            raise ValueError(f"worker {hello.worker_id!r} is already registered")
        record = WorkerRecord(hello=hello, repository=frozenset(hello.repository))
        self._workers[hello.worker_id] = record
        return record

    def remove(self, worker_id: str) -> WorkerRecord | None:
        return self._workers.pop(worker_id, None)

    def report(self, worker_id: str, slots: Sequence[SlotStatus]) -> dict[str, SlotStatus]:
        """Replace the worker's slots with a full report; return the previous ones."""
        record = self._workers[worker_id]
        previous = record.slots
        record.slots = {slot.model_id: slot for slot in slots}
        return previous

    def knows(self, model_id: str) -> bool:
        """Some connected worker can load `model_id` or already has a slot for it."""
        return any(model_id in w.repository or model_id in w.slots for w in self._workers.values())

    def holds(self, model_id: str) -> bool:
        """Some connected worker holds `model_id` READY or LOADING."""
        return any(w.state_of(model_id) in HOLDING_STATES for w in self._workers.values())

    def grant_candidates(self, model_id: str) -> list[GrantCandidate]:
        return [
            GrantCandidate(w.worker_id, w.inflight.get(model_id, 0))
            for w in self._workers.values()
            if w.state_of(model_id) is SlotState.READY
        ]

    def load_candidates(self, model_id: str) -> list[LoadCandidate]:
        candidates: list[LoadCandidate] = []
        for w in self._workers.values():
            slot = w.slots.get(model_id)
            if model_id not in w.repository or (slot is not None and slot.state in HOLDING_STATES):
                continue
            candidates.append(LoadCandidate(w.worker_id, w.holding(), bool(slot is not None and slot.error)))
        return candidates

    def acquire(self, worker_id: str, key: RequestKey, model_id: str) -> None:
        record = self._workers[worker_id]
        record.granted[key] = model_id
        record.inflight[model_id] = record.inflight.get(model_id, 0) + 1

    def release(self, worker_id: str, key: RequestKey) -> None:
        record = self._workers.get(worker_id)
        if record is None:
            return
        model_id = record.granted.pop(key, None)
        if model_id is None:
            return
        left = record.inflight[model_id] - 1
        if left:
            record.inflight[model_id] = left
        else:
            del record.inflight[model_id]

    def inflight(self, model_id: str) -> int:
        return sum(w.inflight.get(model_id, 0) for w in self._workers.values())
