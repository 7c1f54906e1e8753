"""Retrying, in the two shapes the suite needs (docs/design/gateway.md, "Retries").

- `Backoff`: the delays of a reconnect loop, the long-lived sessions and streams a service
  keeps open (scheduler sessions, the metrics report stream, a Redis subscription): the first
  delay, doubling up to a ceiling, back to the first after a session that went well. The loop
  keeps its own shape (what it logs, when it stops, which clock it sleeps on); this only says
  how long to wait.
- `retry_options(...)`: gRPC's own retry policy (a service config with a `retryPolicy`) for
  unary calls that are safe to send twice, passed as channel options. gRPC retries them
  inside the call, on the codes named (UNAVAILABLE: the peer is not there, or went away
  before it answered), with its own jittered exponential backoff, and never once the server
  has begun to answer.

Why not tenacity or stamina: a reconnect loop is not "call until it succeeds": its session
succeeds for hours, then ends, and must start again from the first delay; it sleeps on the
service's injected clock (tests advance a fake one) or on a stop event. That is a few lines
here and a wrapper around either library. Unary calls are better served by gRPC itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["IDEMPOTENT_CALLS", "Backoff", "retry_options"]


@dataclass(slots=True)
class Backoff:
    """Delays between a reconnect loop's attempts: `first_s`, then doubling, at most `max_s`.

    backoff = Backoff(first_s=0.1, max_s=5.0)
    while running:
        try:
            ...open the stream...
            backoff.reset()            # it opened: the next outage starts from first_s
            ...serve it...
        except ...:
            ...
        await clock.sleep(backoff.next_s())     # 0.1, 0.2, 0.4 ... 5.0, 5.0
    """

    first_s: float
    max_s: float
    _next_s: float = field(init=False)

    def __post_init__(self) -> None:
        if self.first_s <= 0 or self.max_s < self.first_s:
            raise ValueError(f"need 0 < first_s <= max_s, got first_s={self.first_s} max_s={self.max_s}")
        self._next_s = self.first_s

    def next_s(self) -> float:
        """The delay before the next attempt; the one after it doubles (up to `max_s`)."""
        delay = self._next_s
        self._next_s = min(delay * 2, self.max_s)
        return delay

    def reset(self) -> None:
        """The last attempt went well: the next delay is `first_s` again."""
        self._next_s = self.first_s


# Unary calls that may be sent twice with the same effect: reads, and the lease calls that
# carry the caller's request id or fencing token (the broker answers a repeated Acquire with
# the lease it already granted; a Renew extends the same lease). Release, Load, Unload, Pin
# and SetStrategy are left out: a retry after the first one took effect would answer with a
# misleading error.
IDEMPOTENT_CALLS: tuple[tuple[str, str], ...] = (
    ("loadmaster.v1.GpuBrokerService", "Acquire"),
    ("loadmaster.v1.GpuBrokerService", "Renew"),
    ("loadmaster.v1.GpuBrokerService", "RenewMany"),
    ("loadmaster.v1.GpuBrokerService", "ListLeases"),
    ("loadmaster.v1.GpuBrokerService", "Inventory"),
    ("loadmaster.v1.SchedulerService", "ListWorkers"),
    ("loadmaster.v1.SchedulerService", "GetQueues"),
    ("loadmaster.v1.ModelPoolService", "Status"),
    ("loadmaster.v1.MetricsService", "GetStats"),
    ("loadmaster.v1.MetricsService", "GetLatest"),
    ("loadmaster.v1.MetricsService", "GetModelStatistics"),
)


def retry_options(
    calls: Iterable[tuple[str, str]] = IDEMPOTENT_CALLS,
    *,
    max_attempts: int = 3,
    initial_backoff_s: float = 0.1,
    max_backoff_s: float = 1.0,
    multiplier: float = 2.0,
    codes: Iterable[str] = ("UNAVAILABLE",),
) -> list[tuple[str, Any]]:
    """Channel options that make gRPC retry `calls` ((service, method) pairs, the service with
    its proto package) on `codes`, `max_attempts` in all (gRPC caps it at 5), waiting a random
    time up to initial_backoff_s x multiplier^n (at most max_backoff_s) between attempts.
    The call's own timeout bounds every attempt together."""
    if not 2 <= max_attempts <= 5:
        raise ValueError(f"max_attempts: between 2 and 5 (gRPC's limit), got {max_attempts}")
    config = {
        "methodConfig": [
            {
                "name": [{"service": service, "method": method} for service, method in calls],
                "retryPolicy": {
                    "maxAttempts": max_attempts,
                    "initialBackoff": f"{initial_backoff_s:g}s",
                    "maxBackoff": f"{max_backoff_s:g}s",
                    "backoffMultiplier": multiplier,
                    "retryableStatusCodes": list(codes),
                },
            }
        ]
    }
    return [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(config))]
