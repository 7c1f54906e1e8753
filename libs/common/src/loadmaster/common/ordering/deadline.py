"""The deadline family: each request gets a virtual deadline, served earliest first.

    slack_ms = min(latency budget, max(cadence, service_ms))   the client needs its answer before
                                                       its next observation, at the latest
                                                       by its budget
               x (1 - urgency_weight x urgency)        urgency 0..1 shortens it
               x (min(steps, horizon) + 1) / (horizon + 1)   few steps left: sooner
               + priority x priority_step_ms           lower priorities wait longer...
               + queued_by_client x service_ms         ...and so does a client's n-th
                                                       queued request (fair share)
    virtual deadline = enqueued_at + slack_ms / 1000

The deadline is an absolute time fixed at admission, so age needs no revisiting: a
request that waits keeps its place while newer ones land behind it. This bounds
starvation: a priority-p request is served before any priority-0 request that arrived
more than p x priority_step_ms + (its slack - theirs without priority) after it.
A registered policy replaces the slack computation.

`model_deadline`: per-model queues. `deadline_aware`: one global order. `tiered_deadline`:
strict tiers by priority (`tiers` = the highest priority of each tier), deadline order
inside a tier, one global order.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from loadmaster.common.ordering.base import BatchRule, Scope, SortKey
from loadmaster.common.ordering.policies import InferenceRequest, Policy
from loadmaster.common.ordering.requests import Request

__all__ = ["DeadlineOrdering", "DeadlineTerms", "policy_view", "slack_ms"]


@dataclass(frozen=True, slots=True)
class DeadlineTerms:
    priority_step_ms: float = 100.0
    urgency_weight: float = 0.5
    steps_horizon: int = 8
    service_ms: float = 10.0


def slack_ms(request: Request, terms: DeadlineTerms) -> float:
    """How long `request` may wait from its arrival (before priority tiers apply).

    Runs once per admitted request: the clamps are comparisons, not min()/max() calls,
    which cost as much again as the rest of the function."""
    info = request.info
    slack = request.budget_ms
    cadence = request.cadence_ms
    if cadence is not None:
        # a burst (gap ~0) must not make a client more urgent than one service time
        if terms.service_ms > cadence:
            cadence = terms.service_ms
        if cadence < slack:
            slack = cadence
    urgency = info.urgency
    if urgency < 0.0:
        urgency = 0.0
    elif urgency > 1.0:
        urgency = 1.0
    slack *= 1.0 - terms.urgency_weight * urgency
    steps = info.steps_remaining
    if steps is not None:
        horizon = terms.steps_horizon
        if steps > horizon:
            steps = horizon
        slack *= (steps + 1) / (horizon + 1)
    slack += info.priority * terms.priority_step_ms
    slack += request.backlog * terms.service_ms
    return slack


def policy_view(request: Request) -> InferenceRequest:
    info = request.info
    return InferenceRequest(
        client_id=info.client_id,
        model_id=info.model_id,
        priority=info.priority,
        urgency=info.urgency,
        steps_remaining=info.steps_remaining,
        latency_budget_ms=request.budget_ms,
        cadence_ms=request.cadence_ms,
        queued_by_client=request.backlog,
    )


class DeadlineOrdering:
    batch: BatchRule | None = None

    def __init__(
        self,
        name: str,
        *,
        scope: Scope,
        terms: DeadlineTerms | None = None,
        tiers: list[int] | None = None,
        policy: Policy | None = None,
        policy_name: str = "",
    ) -> None:
        self._name = name
        self.scope = scope
        self.terms = terms if terms is not None else DeadlineTerms()
        self._tiers = sorted(tiers) if tiers is not None else None
        self._policy = policy
        self.policy_name = policy_name
        self._last: dict[tuple[str, str], float] = {}  # (client, model) -> its latest virtual deadline

    @property
    def name(self) -> str:
        return self._name

    @property
    def tiers(self) -> list[int] | None:
        """The highest priority of each tier (tiered_deadline), or None."""
        return self._tiers

    def tier(self, priority: int) -> int:
        """The index of the first tier whose highest priority is >= `priority`."""
        if self._tiers is None:
            return 0
        return bisect.bisect_left(self._tiers, priority)

    def key(self, request: Request) -> SortKey:
        """(tier,) virtual deadline, arrival. The virtual deadline is enqueued_at + slack, never
        earlier than the same client's previous request for the same model (a client's
        requests keep their order: a burst's 2nd request, whose cadence is already known,
        must not pass its 1st)."""
        vd = self._virtual_deadline(request)
        client_id = request.info.client_id
        if client_id:
            self._last[(client_id, request.model_id)] = vd
        return self._sort_key(request, vd)

    def _virtual_deadline(self, request: Request) -> float:
        if self._policy is not None:
            slack = float(self._policy(policy_view(request)))
        else:
            slack = slack_ms(request, self.terms)
        vd = request.enqueued_at + slack / 1000.0
        client_id = request.info.client_id
        if client_id:
            previous = self._last.get((client_id, request.model_id))
            if previous is not None and previous > vd:
                vd = previous
        return vd

    def _sort_key(self, request: Request, vd: float) -> SortKey:
        if self._tiers is None:
            return (vd, request.arrival)
        return (self.tier(request.info.priority), vd, request.arrival)

    def granted(self, request: Request, key: SortKey) -> None:
        pass

    def forget_client(self, client_id: str) -> None:
        for stream in [s for s in self._last if s[0] == client_id]:
            del self._last[stream]
