"""What the core keeps per admitted request and per model while it runs: shared by the
core (admission, completion, expiry) and its dispatcher (grants)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from loadmaster.scheduler.domain import Request, RequestInfo, RequestKey

__all__ = ["ModelStats", "Outstanding", "Tracked", "reached_gateway"]

_MAX_REPORT_WAIT_S = 1.0  # the most a late credit-run report moves its arrival back


def reached_gateway(info: RequestInfo, now: float, wall_now: float) -> float:
    """When a credit run reached its gateway, on the monotonic clock (`now`; `wall_now` is the
    same instant in Unix seconds): its report waits up to the gateway's report delay, which the
    client's cadence must not see. Bounded, so a gateway whose clock is off cannot move it far."""
    if not info.received_unix_ns:
        return now
    waited = wall_now - info.received_unix_ns / 1e9
    return now - min(max(waited, 0.0), _MAX_REPORT_WAIT_S)


@dataclass(slots=True)
class Tracked:
    """An admitted request that has not ended yet (queued or granted)."""

    request: Request
    attempts: int = 0
    worker_id: str | None = None  # set while granted
    credit_id: str | None = None  # set while it runs on a dispatch credit's lent slot


@dataclass(slots=True)
class ModelStats:
    expired: int = 0
    overflowed: int = 0
    granted: int = 0
    superseded: int = 0
    dropped: int = 0  # client disconnected


class Outstanding:
    """Each client's unfinished requests (queued or running), per model: its backlog when it
    sends again, what `latest_only` supersedes, what its disconnection drops. Empty entries are
    removed, so memory follows the clients with requests."""

    __slots__ = ("_by_client",)

    def __init__(self) -> None:
        self._by_client: dict[str, dict[str, set[RequestKey]]] = {}

    def add(self, client_id: str, model_id: str, key: RequestKey) -> None:
        # (not setdefault: its default would be built on every call, once per request)
        by_model = self._by_client.get(client_id)
        if by_model is None:
            by_model = self._by_client[client_id] = {}
        keys = by_model.get(model_id)
        if keys is None:
            keys = by_model[model_id] = set()
        keys.add(key)

    def discard(self, client_id: str, model_id: str, key: RequestKey) -> None:
        by_model = self._by_client.get(client_id)
        if by_model is None:
            return
        keys = by_model.get(model_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del by_model[model_id]
                if not by_model:
                    del self._by_client[client_id]

    def keys(self, client_id: str, model_id: str) -> set[RequestKey]:
        """The client's unfinished requests for the model (empty: a new set, not stored)."""
        by_model = self._by_client.get(client_id)
        return by_model.get(model_id, set()) if by_model is not None else set()

    def of_client(self, client_id: str) -> Iterator[RequestKey]:
        for keys in self._by_client.get(client_id, {}).values():
            yield from keys
