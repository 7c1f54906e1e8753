"""What the scheduler knows about clients: cadence, liveness, and the one check timer entry each.

A client's cadence is the EWMA of its inter-arrival time (`cadence_alpha`). A client
silent for `disconnect_timeout_s` is marked disconnected once and forgotten; its next
request brings it back as a new client. Liveness checks are timer-driven: one heap entry per active client
at last_seen + timeout, re-armed from the real last_seen when it comes due.
Pure bookkeeping over an injected time value; no I/O.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

__all__ = ["ClientTracker"]


@dataclass(slots=True)
class _Client:
    last_seen: float
    cadence_s: float | None = None
    scheduled: bool = False  # has an entry in the check heap


class ClientTracker:
    def __init__(self, *, cadence_alpha: float = 0.3, disconnect_timeout_s: float = 10.0) -> None:
        if not 0.0 < cadence_alpha < 1.0:
            raise ValueError(f"cadence_alpha must be in (0, 1), got {cadence_alpha}")
        self._alpha = cadence_alpha
        self._timeout_s = disconnect_timeout_s
        self._clients: dict[str, _Client] = {}
        self._checks: list[tuple[float, str]] = []
        self._active = 0

    @property
    def alpha(self) -> float:
        return self._alpha

    @property
    def active(self) -> int:
        return self._active

    def cadence_ms(self, client_id: str) -> float | None:
        client = self._clients.get(client_id)
        if client is None or client.cadence_s is None:
            return None
        return client.cadence_s * 1000.0

    def observe(self, client_id: str, now: float) -> bool:
        """A request from `client_id` arrived at `now`; True if the client is new or came back."""
        client = self._clients.get(client_id)
        if client is None:
            client = self._clients[client_id] = _Client(last_seen=now)
            self._active += 1
            self._schedule(client_id, client)
            return True
        gap = now - client.last_seen
        if gap < 0.0:
            gap = 0.0
        cadence_s = client.cadence_s
        client.cadence_s = gap if cadence_s is None else self._alpha * gap + (1.0 - self._alpha) * cadence_s
        client.last_seen = now
        if not client.scheduled:
            self._schedule(client_id, client)
        return False

    def next_check(self) -> float | None:
        return self._checks[0][0] if self._checks else None

    def due_disconnects(self, now: float) -> list[str]:
        """Clients silent past the timeout at `now`, each reported once per silence."""
        gone: list[str] = []
        while self._checks and self._checks[0][0] <= now:
            _, client_id = heapq.heappop(self._checks)
            client = self._clients[client_id]
            client.scheduled = False
            if now - client.last_seen >= self._timeout_s:
                del self._clients[client_id]  # one that comes back starts afresh
                self._active -= 1
                gone.append(client_id)
            else:
                self._schedule(client_id, client)
        return gone

    def _schedule(self, client_id: str, client: _Client) -> None:
        client.scheduled = True
        heapq.heappush(self._checks, (client.last_seen + self._timeout_s, client_id))
