"""`round_robin` (fair rotation across clients) and `batch_optimized` (per-model groups).

Round robin gives each client's n-th waiting request for a model round n, counted from
the round being served when it arrived, so a client that joins late does not jump ahead
of everyone and a client that floods waits its turn: one request per client per round.
"""

from __future__ import annotations

from loadmaster.common.ordering.base import BatchRule, Scope, SortKey
from loadmaster.common.ordering.requests import Request

__all__ = ["BatchOrdering", "RoundRobinOrdering"]


class RoundRobinOrdering:
    scope = Scope.MODEL
    batch: BatchRule | None = None

    def __init__(self) -> None:
        self._next_round: dict[tuple[str, str], int] = {}  # (model, client) -> its next round
        self._serving: dict[str, int] = {}  # model -> round of the last grant

    @property
    def name(self) -> str:
        return "round_robin"

    def key(self, request: Request) -> SortKey:
        model_id = request.model_id
        client = (model_id, request.info.client_id)
        round_ = max(self._next_round.get(client, 0), self._serving.get(model_id, 0))
        self._next_round[client] = round_ + 1
        return (round_, request.arrival)

    def granted(self, request: Request, key: SortKey) -> None:
        model_id = request.model_id
        if key[0] > self._serving.get(model_id, 0):
            self._serving[model_id] = int(key[0])

    def forget_client(self, client_id: str) -> None:
        for stream in [s for s in self._next_round if s[1] == client_id]:
            del self._next_round[stream]


class BatchOrdering:
    """FIFO per model; the core holds each model's queue until its batch rule releases it."""

    scope = Scope.MODEL

    def __init__(self, rule: BatchRule) -> None:
        self.batch: BatchRule | None = rule

    @property
    def name(self) -> str:
        return "batch_optimized"

    def key(self, request: Request) -> SortKey:
        return (request.arrival,)

    def granted(self, request: Request, key: SortKey) -> None:
        pass

    def forget_client(self, client_id: str) -> None:
        pass
