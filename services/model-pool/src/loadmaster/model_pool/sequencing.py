"""Admission to a generative engine that orders nothing itself (an engine process).

Pure bookkeeping over `generation_order.GenerationOrder`, no engine and no loop: the
generation port (`generation_port.py`) asks and acts. At most `capacity` generations run (the
engine's `max_sequences`, so the engine's own FIFO never holds a backlog that outranks a
newcomer); the rest wait here in the policy's order (priority class, tenant counter,
arrival). It never pauses a running generation: an engine process cannot keep a paused
sequence's cache. The transformers engine orders its own queue inside its manager, with
preemption (`engines/_cb_scheduler.py`), and needs no sequencer.

    sequencer.arrive(id, priority=, tenant=, weight=)  -> ids to start now (maybe none)
    sequencer.finished(id)                             -> ids to start now
    sequencer.progressed(id, n)                        -> n more output tokens (charged)
"""

from __future__ import annotations

from loadmaster.model_pool.generation_order import GenerationOrder, OrderPolicy, Transition

__all__ = ["Sequencer"]


class Sequencer:
    def __init__(self, capacity: int, policy: OrderPolicy | None = None) -> None:
        self.capacity = capacity
        self._order = GenerationOrder(policy)

    @property
    def running(self) -> int:
        return len(self._order.running)

    @property
    def waiting(self) -> int:
        return len(self._order.waiting)

    def is_waiting(self, request_id: str) -> bool:
        entry = self._order.entry(request_id)
        return entry is not None and not entry.running

    def position(self, request_id: str, now: float) -> int | None:
        """How many generations are ahead of a waiting one (None: running or unknown)."""
        return self._order.positions(now).get(request_id) if self.is_waiting(request_id) else None

    def arrive(self, request_id: str, *, priority: int, tenant: str, weight: float, now: float) -> list[str]:
        self._order.add(request_id, priority=priority, tenant=tenant, weight=weight, prompt_tokens=0, now=now)
        return self._admit(now)

    def progressed(self, request_id: str, tokens: int) -> None:
        self._order.progressed(request_id, tokens)

    def charge_prompt(self, request_id: str, tokens: int) -> None:
        """The prompt's length, once known (an engine process tokenises it itself)."""
        entry = self._order.entry(request_id)
        if entry is not None and tokens > 0:
            self._order.counters.charge_prompt(entry.tenant, tokens, entry.weight)

    def tenant_service(self) -> dict[str, float]:
        return dict(self._order.counters.service)

    def set_remote_service(self, service: dict[str, float]) -> None:
        self._order.counters.set_remote(service)

    def finished(self, request_id: str, now: float) -> list[str]:
        """The generation ended (or was cancelled while waiting): its place, if any, is free."""
        if self._order.remove(request_id) is None:
            return []
        return self._admit(now)

    def _admit(self, now: float) -> list[str]:
        plan = self._order.plan(capacity=self.capacity, now=now, can_pause=False)
        return [request_id for kind, request_id in plan.transitions if kind is Transition.START]
