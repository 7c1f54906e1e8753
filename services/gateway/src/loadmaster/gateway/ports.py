"""What the dispatcher and the generation streams need from the scheduler session and the worker
links: protocols that `SchedulerLink` and `WorkerLinks` satisfy and unit tests stand in for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from loadmaster.v1 import scheduler_pb2

__all__ = ["SchedulerPort", "SchedulerSession", "WorkerPort"]


class SchedulerSession(Protocol):
    """Queueing one request on the scheduler session: enqueue, complete, cancel."""

    @property
    def connected(self) -> bool: ...

    @property
    def session(self) -> int:
        """Which session is (or was last) open: it changes with every new session."""

    def enqueue(self, request: scheduler_pb2.RequestInfo) -> None: ...

    def complete(
        self,
        request_id: str,
        *,
        error_code: int = 0,
        retryable: bool = False,
        worker_id: str = "",
        inference_ms: float = 0.0,
        deferred: bool = False,
    ) -> None: ...

    def cancel(self, request_id: str) -> None: ...


class SchedulerPort(SchedulerSession, Protocol):
    """All the dispatcher sends on the scheduler session (`SchedulerLink`), credits included."""

    def report_run(
        self,
        request_id: str,
        model_id: str,
        info: Callable[[], scheduler_pb2.RequestInfo],
    ) -> None: ...

    def return_credit(self, credit_id: str) -> None: ...

    def report_local_depth(self, model_id: str, waiting: int, outstanding_s: float = 0.0) -> None: ...


class WorkerPort(Protocol):
    """Where the dispatcher sends requests to workers (`WorkerLinks`)."""

    def send(self, endpoint: str, envelope: bytes, payload: Any) -> None: ...
