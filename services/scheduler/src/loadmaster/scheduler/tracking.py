"""What the core keeps per admitted request and per model while it runs: shared by the
core (admission, completion, expiry) and its dispatcher (grants)."""

from __future__ import annotations

from dataclasses import dataclass

from loadmaster.scheduler.domain import Request, RequestInfo

__all__ = ["ModelStats", "Tracked", "reached_gateway"]

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
