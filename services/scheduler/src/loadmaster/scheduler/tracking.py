"""What the core keeps per admitted request and per model while it runs: shared by the
core (admission, completion, expiry) and its dispatcher (grants)."""

from __future__ import annotations

from dataclasses import dataclass

from loadmaster.scheduler.domain import Request

__all__ = ["ModelStats", "Tracked"]


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
