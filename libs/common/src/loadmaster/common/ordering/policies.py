"""Custom policies for the deadline family: `@register_policy("name")` on a function
`InferenceRequest -> float`.

The function returns the request's **slack in milliseconds**: how long it may wait from
its arrival. The strategy orders by virtual deadline = arrival time + slack, earliest
first, so a waiting request still gains on newer ones whatever the policy returns.
(Inferential's policies return a score, higher first; ours return a wait allowance,
smaller first, because a score fixed at submit cannot age.)

Modules named in `scheduler.policy_modules` are imported when the scheduler starts;
their decorators fill the registry.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["InferenceRequest", "Policy", "get_policy", "load_policy_modules", "register_policy"]


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """What a policy sees of a request (metadata only, fixed at admission)."""

    client_id: str
    model_id: str
    priority: int  # 0 = highest
    urgency: float  # 0..1
    steps_remaining: int | None
    latency_budget_ms: float
    cadence_ms: float | None  # EWMA of the client's inter-arrival time; None before 2 arrivals
    queued_by_client: int  # the client's requests already waiting for this model
    retry_count: int = 0


Policy = Callable[[InferenceRequest], float]

_POLICIES: dict[str, Policy] = {}


def register_policy(name: str) -> Callable[[Policy], Policy]:
    """Register `fn` under `name` (a later registration under the same name replaces it)."""
    if not name:
        raise ValueError("a policy needs a name")

    def decorator(fn: Policy) -> Policy:
        _POLICIES[name] = fn
        return fn

    return decorator


def get_policy(name: str) -> Policy:
    try:
        return _POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(_POLICIES)) or "none registered"
        raise ValueError(f"unknown policy {name!r} (known: {known})") from None


def load_policy_modules(modules: list[str]) -> None:
    """Import each module so its `@register_policy` decorators run."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"scheduler.policy_modules: cannot import {module!r}: {exc}") from exc
