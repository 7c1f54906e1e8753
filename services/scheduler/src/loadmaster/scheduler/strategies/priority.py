"""Priority ordering: priority ascending (0 = highest), then urgency descending, then arrival."""

from __future__ import annotations

from loadmaster.scheduler.domain import Request
from loadmaster.scheduler.strategies.base import SortKey

__all__ = ["PriorityOrdering"]


class PriorityOrdering:
    @property
    def name(self) -> str:
        return "priority"

    def key(self, request: Request) -> SortKey:
        info = request.info
        return (info.priority, -info.urgency, request.arrival)
