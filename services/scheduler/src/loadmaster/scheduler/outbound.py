"""The scheduler core's outward interfaces: where its answers and its samples go.

The core calls these synchronously and does no I/O itself; the session layer
(`sessions.SchedulerHub`) implements `Outbound` by routing to stream outboxes, and
`loadmaster.common.telemetry.TelemetryReporter` satisfies `Telemetry`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from loadmaster.scheduler.domain import Credit, Grant, Reject, WorkerCommand

__all__ = ["NoTelemetry", "Outbound", "Telemetry"]


class Outbound(Protocol):
    """Where the core's answers go (the session layer routes them to streams)."""

    def grant(self, session_id: int, grant: Grant) -> None: ...

    def reject(self, session_id: int, reject: Reject) -> None: ...

    def command(self, worker_id: str, command: WorkerCommand) -> None: ...

    def lend_credit(self, session_id: int, credit: Credit) -> None: ...

    def revoke_credit(self, session_id: int, credit_id: str) -> None: ...


class Telemetry(Protocol):
    def record(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None: ...


class NoTelemetry:
    """Telemetry that goes nowhere (tests, benchmarks)."""

    def record(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        pass
