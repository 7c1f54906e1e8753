"""Ordering strategies: how requests waiting for one model are ranked.

A strategy turns a queued `Request` into a sort key (smaller = served first).
`make_ordering(name)` builds one by name; today only `priority` exists.
"""

from __future__ import annotations

from collections.abc import Callable

from loadmaster.scheduler.strategies.base import Ordering, SortKey
from loadmaster.scheduler.strategies.priority import PriorityOrdering

__all__ = ["ORDERINGS", "Ordering", "PriorityOrdering", "SortKey", "make_ordering"]

ORDERINGS: dict[str, Callable[[], Ordering]] = {"priority": PriorityOrdering}


def make_ordering(name: str) -> Ordering:
    try:
        return ORDERINGS[name]()
    except KeyError:
        raise ValueError(f"unknown ordering strategy {name!r}; known: {sorted(ORDERINGS)}") from None
