"""Admission to a generative engine that does not order its own queue.

Pure bookkeeping over `generation_order.GenerationOrder`, no engine and no loop: the
generation port (`generation_port.py`) asks and acts. At most `capacity` generations run (the
engine's `max_sequences`, so the engine's own queue never holds a backlog that outranks a
newcomer); the rest wait here in the policy's order (priority class, tenant counter,
arrival). With `can_pause` (an engine that can pause a sequence and keep its cache, such as
the vision-language one), a class-0 arrival pauses the lowest-class running generation and
timeslices apply; an engine process cannot, so there priority decides who starts next, never
who stops. The transformers engine orders its own queue inside its manager
(`engines/_cb_scheduler.py`) and needs no sequencer.

    sequencer.arrive(id, priority=, tenant=, weight=, now=)  -> transitions to make now
    sequencer.finished(id, now)                             -> transitions to make now
    sequencer.progressed(id, n, now)                        -> n more output tokens (charged);
                                                               a used-up timeslice may yield
"""

from __future__ import annotations

from loadmaster.model_pool.generation_order import GenerationOrder, OrderPolicy, Transition

__all__ = ["Sequencer"]


Transitions = list[tuple[Transition, str]]


class Sequencer:
    def __init__(self, capacity: int, policy: OrderPolicy | None = None, *, can_pause: bool = False) -> None:
        self.capacity = capacity
        self.can_pause = can_pause
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

    def arrive(
        self, request_id: str, *, priority: int, tenant: str, weight: float, now: float
    ) -> Transitions:
        self._order.add(request_id, priority=priority, tenant=tenant, weight=weight, prompt_tokens=0, now=now)
        return self._admit(now)

    def progressed(self, request_id: str, tokens: int, now: float) -> Transitions:
        self._order.progressed(request_id, tokens)
        return self._admit(now) if self.can_pause and self._order.waiting else []

    def charge_prompt(self, request_id: str, tokens: int) -> None:
        """The prompt's length, once known (an engine process tokenises it itself)."""
        entry = self._order.entry(request_id)
        if entry is not None and tokens > 0:
            self._order.counters.charge_prompt(entry.tenant, tokens, entry.weight)

    def tenant_service(self) -> dict[str, float]:
        return dict(self._order.counters.service)

    def set_remote_service(self, service: dict[str, float]) -> None:
        self._order.counters.set_remote(service)

    def finished(self, request_id: str, now: float) -> Transitions:
        """The generation ended (or was cancelled while waiting): its place, if any, is free."""
        if self._order.remove(request_id) is None:
            return []
        return self._admit(now)

    def _admit(self, now: float) -> Transitions:
        return self._order.plan(capacity=self.capacity, now=now, can_pause=self.can_pause).transitions
