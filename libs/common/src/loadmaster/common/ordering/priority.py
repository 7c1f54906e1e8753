"""Priority orderings: strict tiers by priority (0 = highest).

`priority` (the original order) breaks ties by urgency, then arrival;
`priority_tiered` is FIFO inside a tier.
"""

from __future__ import annotations

from loadmaster.common.ordering.base import BatchRule, Scope, SortKey
from loadmaster.common.ordering.requests import Request

__all__ = ["PriorityOrdering", "PriorityTieredOrdering"]


class PriorityOrdering:
    scope = Scope.MODEL
    batch: BatchRule | None = None

    @property
    def name(self) -> str:
        return "priority"

    def key(self, request: Request) -> SortKey:
        info = request.info
        return (info.priority, -info.urgency, request.arrival)

    def granted(self, request: Request, key: SortKey) -> None:
        pass

    def forget_client(self, client_id: str) -> None:
        pass


class PriorityTieredOrdering:
    scope = Scope.MODEL
    batch: BatchRule | None = None

    @property
    def name(self) -> str:
        return "priority_tiered"

    def key(self, request: Request) -> SortKey:
        return (request.info.priority, request.arrival)

    def granted(self, request: Request, key: SortKey) -> None:
        pass

    def forget_client(self, client_id: str) -> None:
        pass
