"""A harness around `SchedulerCore` with a fake clock, a recording outbound sink, and the
exactly-one-outcome invariant checked over everything that happened."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.scheduler.core import CoreConfig, SchedulerCore
from loadmaster.scheduler.domain import (
    Completion,
    Credit,
    CreditRun,
    FinishedRun,
    Grant,
    Outcome,
    OverflowPolicy,
    Reject,
    RequestInfo,
    RequestKey,
    SlotState,
    SlotStatus,
    Submission,
    WorkerCommand,
    WorkerHello,
)
from loadmaster.v1 import errors_pb2


@dataclass(slots=True)
class _Life:
    """What the invariant checker knows about one enqueued request."""

    state: str = "queued"  # queued | granted | done | dropped
    attempts: int = 0
    worker_id: str = ""
    outcomes: list[str] = field(default_factory=list)


class Harness:
    def __init__(self, config: CoreConfig) -> None:
        self.clock = FakeClock()
        self.outcomes: list[tuple[int, Outcome]] = []
        self.commands: list[tuple[str, WorkerCommand]] = []
        self.lent: dict[str, tuple[int, Credit]] = {}  # credit id -> (session, credit), not returned
        self.revoked: list[str] = []
        self._cursor = 0
        self._lives: dict[RequestKey, _Life] = {}
        self.violations: list[str] = []
        self.recorded: Counter[str] = Counter()  # telemetry: samples by name (and name:kind)
        self.last_value: dict[tuple[str, str], float] = {}  # telemetry: (name, model) -> last value
        # A seeded tie-break between equal workers: a sequence of operations replays exactly.
        self.core = SchedulerCore(
            config, clock=self.clock, outbound=self, telemetry=self, rng=random.Random(0)
        )

    # ---- Outbound ----------------------------------------------------------------

    def grant(self, session_id: int, grant: Grant) -> None:
        self.outcomes.append((session_id, grant))
        life = self._lives.get((session_id, grant.request_id))
        if life is None or life.state != "queued":
            self.violations.append(f"grant for {grant.request_id} in state {life and life.state}")
            return
        if grant.attempt != life.attempts + 1:
            self.violations.append(f"grant {grant.request_id} attempt {grant.attempt} after {life.attempts}")
        life.state, life.attempts, life.worker_id = "granted", grant.attempt, grant.worker_id

    def reject(self, session_id: int, reject: Reject) -> None:
        self.outcomes.append((session_id, reject))
        life = self._lives.get((session_id, reject.request_id))
        if life is None:
            self.violations.append(f"reject for unknown request {reject.request_id}")
            return
        if life.state != "queued":
            self.violations.append(f"reject for {reject.request_id} in state {life.state}")
        life.state = "done"

    def command(self, worker_id: str, command: WorkerCommand) -> None:
        self.commands.append((worker_id, command))

    def lend_credit(self, session_id: int, credit: Credit) -> None:
        self.lent[credit.credit_id] = (session_id, credit)

    def revoke_credit(self, session_id: int, credit_id: str) -> None:
        self.revoked.append(credit_id)

    # ---- Telemetry ---------------------------------------------------------------

    def record(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        self.recorded[name] += 1
        self.last_value[(name, (labels or {}).get("model", ""))] = value
        if labels and "kind" in labels:
            self.recorded[f"{name}:{labels['kind']}"] += 1

    # ---- driving -----------------------------------------------------------------

    def worker(
        self,
        worker_id: str,
        repository: Iterable[str] = ("m",),
        *,
        ready: Iterable[str] = (),
    ) -> None:
        repository = tuple(repository)
        for life in self._lives.values():  # a hello under a known id replaces that worker
            if life.state == "granted" and life.worker_id == worker_id:
                life.state = "queued"
        self.lent = {cid: entry for cid, entry in self.lent.items() if entry[1].worker_id != worker_id}
        self.core.add_worker(WorkerHello(worker_id, f"tcp://{worker_id}:5556", repository=repository))
        ready = tuple(ready)
        if ready:
            self.report(worker_id, {m: SlotState.READY for m in ready})

    def report(self, worker_id: str, states: dict[str, SlotState], *, error: str = "", gen: int = 1) -> None:
        self.core.update_worker(
            worker_id,
            [
                SlotStatus(m, s, generation=gen, error=error if s is SlotState.IDLE else "")
                for m, s in states.items()
            ],
        )

    def lose_worker(self, worker_id: str) -> None:
        for life in self._lives.values():
            if life.state == "granted" and life.worker_id == worker_id:
                life.state = "queued"
        self.lent = {cid: entry for cid, entry in self.lent.items() if entry[1].worker_id != worker_id}
        self.core.remove_worker(worker_id)

    def enqueue(
        self,
        *request_ids: str,
        model: str = "m",
        session: int = 1,
        client: str = "",
        priority: int = 0,
        urgency: float = 0.0,
        timeout_ms: float = 0.0,
    ) -> None:
        self.enqueue_batch(
            [
                RequestInfo(
                    r, model, client_id=client, priority=priority, urgency=urgency, timeout_ms=timeout_ms
                )
                for r in request_ids
            ],
            session=session,
        )

    def enqueue_batch(self, infos: list[RequestInfo], *, session: int = 1) -> None:
        for info in infos:
            self._lives.setdefault((session, info.request_id), _Life())
        self.core.submit(session, Submission(enqueues=infos))

    def complete(
        self,
        request_id: str,
        *,
        session: int = 1,
        error: int = errors_pb2.ERROR_CODE_UNSPECIFIED,
        retryable: bool = False,
        worker: str | None = None,
        inference_ms: float = 0.0,
    ) -> None:
        life = self._lives[(session, request_id)]
        completion = Completion(
            request_id, error, retryable, worker if worker is not None else life.worker_id, inference_ms
        )
        if life.state == "granted" and completion.worker_id == life.worker_id:
            final = error == errors_pb2.ERROR_CODE_UNSPECIFIED or not retryable
            life.state = "done" if final else "queued"
        self.core.submit(session, Submission(completes=[completion]))

    def run(
        self,
        request_id: str,
        credit_id: str,
        *,
        model: str = "m",
        session: int = 1,
        client: str = "",
        priority: int = 0,
    ) -> None:
        """The gateway sent `request_id` on a credit; if the core does not hold that credit
        for this session, it queues the request instead (the harness expects a grant then)."""
        entry = self.lent.get(credit_id)
        life = self._lives.setdefault((session, request_id), _Life())
        if entry is not None and entry[0] == session:
            life.state, life.attempts, life.worker_id = "granted", 1, entry[1].worker_id
        info = RequestInfo(request_id, model, client_id=client, priority=priority)
        self.core.submit(session, Submission(runs=[CreditRun(credit_id, info)]))

    def finished(
        self,
        request_id: str,
        credit_id: str,
        *,
        error: int = 0,
        retryable: bool = False,
        session: int = 1,
        model: str = "m",
        client: str = "",
        priority: int = 0,
        received_unix_ns: int = 0,
        inference_ms: float = 0.0,
    ) -> None:
        """The gateway reports a credit run only after it ended. Ended for good, it needs
        nothing more; a retryable failure is queued again (the harness expects a grant)."""
        life = self._lives.setdefault((session, request_id), _Life())
        final = error == errors_pb2.ERROR_CODE_UNSPECIFIED or not retryable
        entry = self.lent.get(credit_id)
        on_credit = entry is not None and entry[0] == session
        life.state, life.attempts = ("done" if final else "queued"), 1 if on_credit else 0
        info = RequestInfo(
            request_id, model, client_id=client, priority=priority, received_unix_ns=received_unix_ns
        )
        worker_id = entry[1].worker_id if entry else ""
        completion = Completion(request_id, error, retryable, worker_id, inference_ms)
        self.core.submit(session, Submission(finished=[FinishedRun(CreditRun(credit_id, info), completion)]))

    def return_credit(self, credit_id: str, *, session: int = 1) -> None:
        self.lent.pop(credit_id, None)
        self.core.submit(session, Submission(returns=[credit_id]))

    def idle_credits(self, model: str = "m") -> list[str]:
        """Credits lent for `model`, not revoked, with nothing running on them."""
        return [
            cid
            for cid, (_, c) in self.lent.items()
            if c.model_id == model and cid not in self.revoked and not c.running
        ]

    def cancel(self, request_id: str, *, session: int = 1) -> None:
        life = self._lives[(session, request_id)]
        if life.state == "queued":
            life.state = "dropped"
        self.core.submit(session, Submission(cancels=[request_id]))

    def close_session(self, session: int) -> None:
        self.lent = {cid: entry for cid, entry in self.lent.items() if entry[0] != session}
        for key, life in self._lives.items():
            if key[0] == session and life.state in ("queued", "granted"):
                life.state = "dropped"
        self.core.close_session(session)

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.core.expire_due()

    # ---- reading -----------------------------------------------------------------

    def take(self) -> list[Outcome]:
        """Outcomes since the last take."""
        new = [outcome for _, outcome in self.outcomes[self._cursor :]]
        self._cursor = len(self.outcomes)
        return new

    def grants(self) -> list[Grant]:
        return [o for _, o in self.outcomes if isinstance(o, Grant)]

    def rejects(self) -> list[Reject]:
        return [o for _, o in self.outcomes if isinstance(o, Reject)]

    def granted_ids(self) -> list[str]:
        return [g.request_id for g in self.grants()]

    def state(self, request_id: str, *, session: int = 1) -> str:
        return self._lives[(session, request_id)].state

    def check(self, *, settled: bool = False) -> None:
        """No outcome broke the state machine; with `settled`, every request has ended."""
        assert not self.violations, self.violations
        if settled:
            open_ = {
                k: life.state for k, life in self._lives.items() if life.state not in ("done", "dropped")
            }
            assert not open_, f"requests without a final outcome: {open_}"


def config(**overrides: Any) -> CoreConfig:
    base: dict[str, Any] = {
        "max_queue_size": 100,
        "request_ttl_ms": 1000.0,
        "overflow_policy": OverflowPolicy.REJECT_NEWEST,
        "max_retries": 1,
        "max_inflight": lambda model_id: 1,
    }
    base.update(overrides)
    return CoreConfig(**base)


MakeHarness = Callable[..., Harness]


@pytest.fixture
def h() -> Harness:
    return Harness(config())


@pytest.fixture
def make_harness() -> MakeHarness:
    """`make_harness(max_queue_size=2, ...)`: a harness with CoreConfig overrides."""
    return lambda **overrides: Harness(config(**overrides))
