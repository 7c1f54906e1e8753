"""Ordering strategies: how waiting requests are ranked, by the scheduler's central queues
and by a gateway's local queue on its share of slots (docs/data-path.md).

`make_ordering(name, ...)` builds one by name:

| name | queues | order |
|---|---|---|
| `model_deadline` (default) | per model | virtual deadline, earliest first |
| `deadline_aware` | one global | virtual deadline, earliest first |
| `tiered_deadline` | one global, per priority tier | tier, then virtual deadline |
| `batch_optimized` | per model, released in groups | arrival |
| `priority_tiered` | per model | priority, then arrival |
| `round_robin` | per model | one request per client per round |
| `priority` | per model | priority, urgency, arrival (the original order) |
"""

from __future__ import annotations

from loadmaster.common.ordering.base import BatchRule, Ordering, Scope, SortKey
from loadmaster.common.ordering.clients import ClientTracker
from loadmaster.common.ordering.deadline import DeadlineOrdering, DeadlineTerms
from loadmaster.common.ordering.fair import BatchOrdering, RoundRobinOrdering
from loadmaster.common.ordering.policies import (
    InferenceRequest,
    get_policy,
    load_policy_modules,
    register_policy,
)
from loadmaster.common.ordering.priority import PriorityOrdering, PriorityTieredOrdering
from loadmaster.common.ordering.requests import Request, RequestInfo, RequestKey

__all__ = [
    "DEADLINE_FAMILY",
    "STRATEGIES",
    "BatchOrdering",
    "BatchRule",
    "ClientTracker",
    "DeadlineOrdering",
    "DeadlineTerms",
    "InferenceRequest",
    "Ordering",
    "PriorityOrdering",
    "PriorityTieredOrdering",
    "Request",
    "RequestInfo",
    "RequestKey",
    "RoundRobinOrdering",
    "Scope",
    "SortKey",
    "get_policy",
    "load_policy_modules",
    "make_ordering",
    "register_policy",
]

DEADLINE_FAMILY = ("model_deadline", "deadline_aware", "tiered_deadline")
STRATEGIES = (*DEADLINE_FAMILY, "batch_optimized", "priority_tiered", "round_robin", "priority")


def make_ordering(
    name: str,
    *,
    policy: str | None = None,
    terms: DeadlineTerms | None = None,
    tiers: list[int] | None = None,
    batch: BatchRule | None = None,
) -> Ordering:
    """A fresh ordering; `policy` (a registered name) applies to the deadline family only."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")
    if policy and name not in DEADLINE_FAMILY:
        raise ValueError(f"policy {policy!r}: policies apply to {', '.join(DEADLINE_FAMILY)} only")
    fn = get_policy(policy) if policy else None
    if name == "model_deadline":
        return DeadlineOrdering(name, scope=Scope.MODEL, terms=terms, policy=fn, policy_name=policy or "")
    if name == "deadline_aware":
        return DeadlineOrdering(name, scope=Scope.GLOBAL, terms=terms, policy=fn, policy_name=policy or "")
    if name == "tiered_deadline":
        return DeadlineOrdering(
            name,
            scope=Scope.GLOBAL,
            terms=terms,
            tiers=tiers or [0, 1, 2],
            policy=fn,
            policy_name=policy or "",
        )
    if name == "batch_optimized":
        return BatchOrdering(batch if batch is not None else BatchRule(max_batch_size=8, max_wait_s=0.005))
    if name == "priority_tiered":
        return PriorityTieredOrdering()
    if name == "round_robin":
        return RoundRobinOrdering()
    return PriorityOrdering()
