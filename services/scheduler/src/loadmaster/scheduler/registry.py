"""Connected model-pool workers: what they can load, their slots as last reported, and the
grants the scheduler has handed them that are not completed yet.

Plain bookkeeping; the worker's own `inflight` in a report lags, so placement counts
the scheduler's grants instead.

Placement asks for a model's grant candidates once per grant, so they are not built
per call: each READY slot has one `GrantCandidate` whose `inflight` acquire/release
keep current, and the per-model lists (with the sets behind `knows` and `holds`) are
rebuilt only after a hello, a report or a loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from loadmaster.scheduler.domain import HOLDING_STATES, RequestKey, SlotState, SlotStatus, WorkerHello
from loadmaster.scheduler.placement import GrantCandidate, LoadCandidate

__all__ = ["WorkerRecord", "WorkerRegistry", "newly_ready"]


@dataclass(slots=True)
class WorkerRecord:
    hello: WorkerHello
    repository: frozenset[str]
    slots: dict[str, SlotStatus] = field(default_factory=dict)
    granted: dict[RequestKey, str] = field(default_factory=dict)  # request -> model
    inflight: dict[str, int] = field(default_factory=dict)  # model -> grants not completed
    candidates: dict[str, GrantCandidate] = field(default_factory=dict)  # READY model -> candidate
    free_mb: int = 0  # free leased memory by its last report (0 = not reported)
    reported_load: int = 0  # requests in flight on the worker, all models, by its last report

    @property
    def worker_id(self) -> str:
        return self.hello.worker_id

    def holding(self) -> int:
        return sum(1 for slot in self.slots.values() if slot.state in HOLDING_STATES)


class WorkerRegistry:
    def __init__(self) -> None:
        self._workers: dict[str, WorkerRecord] = {}
        # Indexes over the workers, rebuilt on first use after a hello, a report or a loss:
        self._stale = False
        self._known: set[str] = set()  # models some worker can load or has a slot for
        self._holding: set[str] = set()  # models some worker holds READY or LOADING
        self._ready: dict[str, tuple[GrantCandidate, ...]] = {}  # model -> workers holding it READY

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
        self._stale = True
        return record

    def remove(self, worker_id: str) -> WorkerRecord | None:
        self._stale = True
        return self._workers.pop(worker_id, None)

    def report(
        self, worker_id: str, slots: Sequence[SlotStatus], *, free_mb: int = 0
    ) -> dict[str, SlotStatus]:
        """Replace the worker's slots with a full report; return the previous ones."""
        record = self._workers[worker_id]
        previous = record.slots
        record.slots = {slot.model_id: slot for slot in slots}
        record.free_mb = free_mb
        record.reported_load = sum(slot.inflight for slot in slots)
        record.candidates = {
            slot.model_id: GrantCandidate(
                worker_id, record.inflight.get(slot.model_id, 0), record.reported_load
            )
            for slot in slots
            if slot.state is SlotState.READY
        }
        self._stale = True
        return previous

    def knows(self, model_id: str) -> bool:
        """Some connected worker can load `model_id` or already has a slot for it."""
        if self._stale:
            self._reindex()
        return model_id in self._known

    def holds(self, model_id: str) -> bool:
        """Some connected worker holds `model_id` READY or LOADING."""
        if self._stale:
            self._reindex()
        return model_id in self._holding

    def grant_candidates(self, model_id: str) -> tuple[GrantCandidate, ...]:
        """The workers holding `model_id` READY, in registration order. Their `inflight`
        counts move with every acquire/release: read them now, do not keep them."""
        if self._stale:
            self._reindex()
        return self._ready.get(model_id, ())

    def load_candidates(self, model_id: str, *, busy: Callable[[str], bool]) -> list[LoadCandidate]:
        """Workers that could load `model_id`; `busy(m)` tells whether model m has waiters
        (a model with waiters is not evictable: a cold model does not push out a warm one in use)."""
        candidates: list[LoadCandidate] = []
        for w in self._workers.values():
            slot = w.slots.get(model_id)
            if model_id not in w.repository or (slot is not None and slot.state in HOLDING_STATES):
                continue
            evictable = sum(
                1
                for other in w.slots.values()
                if other.state is SlotState.READY
                and not other.pinned
                and not w.inflight.get(other.model_id)
                and not busy(other.model_id)
            )
            candidates.append(
                LoadCandidate(
                    w.worker_id,
                    w.holding(),
                    bool(slot is not None and slot.error),
                    free_mb=w.free_mb,
                    evictable=evictable,
                )
            )
        return candidates

    def acquire(self, worker_id: str, key: RequestKey, model_id: str) -> None:
        record = self._workers[worker_id]
        record.granted[key] = model_id
        record.inflight[model_id] = record.inflight.get(model_id, 0) + 1
        candidate = record.candidates.get(model_id)
        if candidate is not None:
            candidate.inflight += 1

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
        candidate = record.candidates.get(model_id)
        if candidate is not None:
            candidate.inflight = left

    def load_time_ms(self, model_id: str) -> float:
        """The longest last load of `model_id` any connected worker reported (0: none known)."""
        return max(
            (w.slots[model_id].load_time_ms for w in self._workers.values() if model_id in w.slots),
            default=0.0,
        )

    def inflight(self, model_id: str) -> int:
        return sum(w.inflight.get(model_id, 0) for w in self._workers.values())

    def _reindex(self) -> None:
        self._stale = False
        workers = self._workers.values()
        self._known = {m for w in workers for m in (*w.repository, *w.slots)}
        self._holding = {m for w in workers for m, slot in w.slots.items() if slot.state in HOLDING_STATES}
        ready: dict[str, list[GrantCandidate]] = {}
        for w in workers:
            for model_id, candidate in w.candidates.items():
                ready.setdefault(model_id, []).append(candidate)
        self._ready = {model_id: tuple(candidates) for model_id, candidates in ready.items()}


def newly_ready(previous: Mapping[str, SlotStatus], slots: Sequence[SlotStatus]) -> list[str]:
    """Models a slot report shows READY that were not before it (their free slots can be lent)."""
    return [
        slot.model_id
        for slot in slots
        if slot.state is SlotState.READY
        and ((old := previous.get(slot.model_id)) is None or old.state is not SlotState.READY)
    ]
