"""Domain values of the scheduler: what goes in, what comes out, what admin calls see.

Protobuf stays at the wire (`wire.py` translates). The values built once per request
(`RequestInfo`, `Request`, `Completion`, `Grant`, `Reject`, and the dispatch credits' values)
are plain slots dataclasses,
not frozen ones: a frozen dataclass's `__init__` sets each field through
`object.__setattr__` and costs ~7x (4.5 vs 0.65 us for 9 fields, measured here), which
is most of a scheduling decision. Nothing mutates them after construction. Error codes are the `ErrorCode`
enum values of errors.proto (plain ints), as everywhere in loadmaster.common.errors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from loadmaster.common.ordering.deadline import DeadlineTerms
from loadmaster.common.ordering.requests import Request, RequestInfo, RequestKey

__all__ = [
    "HOLDING_STATES",
    "Completion",
    "Credit",
    "CreditRevoke",
    "CreditRun",
    "FinishedRun",
    "Grant",
    "LoadModel",
    "LocalQueueSpec",
    "Outcome",
    "OverflowPolicy",
    "PlacedWorker",
    "Placement",
    "QueueStats",
    "Reject",
    "RemoteService",
    "Request",
    "RequestInfo",
    "RequestKey",
    "RunTally",
    "SlotState",
    "SlotStatus",
    "Submission",
    "UnloadModel",
    "WorkerCommand",
    "WorkerHello",
    "WorkerView",
]

# Registry keys of lent slots use session 0, which no gateway session has.
CREDIT_SLOT_SESSION = 0


class OverflowPolicy(StrEnum):
    DROP_OLDEST = "drop_oldest"
    REJECT_NEWEST = "reject_newest"


class SlotState(StrEnum):
    """A model slot's state on a worker (`ModelState` of model_pool.proto)."""

    UNSPECIFIED = "unspecified"
    IDLE = "idle"
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    UNLOADING = "unloading"


# A worker "holds" a model while it is READY or on its way there.
HOLDING_STATES = frozenset({SlotState.READY, SlotState.LOADING})


@dataclass(slots=True)  # hot path: not frozen (see the module docstring)
class Completion:
    """The gateway's report that a granted request finished (error_code 0 = success)."""

    request_id: str
    error_code: int = 0
    retryable: bool = False
    worker_id: str = ""
    inference_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class WorkerHello:
    worker_id: str
    data_endpoint: str
    grpc_endpoint: str = ""
    node: str = ""
    repository: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SlotStatus:
    """One model slot on a worker, as last reported (`ModelSlotStatus`)."""

    model_id: str
    state: SlotState
    generation: int = 0
    inflight: int = 0
    max_inflight: int = 0
    device: str = ""
    vram_mb: int = 0
    backend: str = ""
    pinned: bool = False
    last_used_unix_ms: int = 0
    loaded_unix_ms: int = 0
    load_time_ms: float = 0.0
    load_started_unix_ms: int = 0
    error: str = ""
    lease_id: str = ""
    priority: int = 0


@dataclass(slots=True)  # hot path: not frozen (see the module docstring)
class Grant:
    request_id: str
    worker_id: str
    data_endpoint: str
    generation: int
    deadline_unix_ns: int
    attempt: int


@dataclass(slots=True)  # hot path: not frozen (see the module docstring)
class Reject:
    request_id: str
    error_code: int
    message: str
    use_share: bool = False  # not an answer: queue it in the gateway's local queue


Outcome = Grant | Reject


@dataclass(frozen=True, slots=True)
class LoadModel:
    model_id: str


@dataclass(frozen=True, slots=True)
class UnloadModel:
    model_id: str


@dataclass(frozen=True, slots=True)
class PlacedWorker:
    """A worker that serves a generative model: where a gateway sends its generations."""

    worker_id: str
    data_endpoint: str
    generation: int


@dataclass(frozen=True, slots=True)
class Placement:
    """Every worker that serves `model_id` now (empty: none), as gateways are told."""

    model_id: str
    workers: tuple[PlacedWorker, ...]


@dataclass(frozen=True, slots=True)
class RemoteService:
    """What each tenant got from each model on the other workers (tenant_service.py)."""

    models: dict[str, dict[str, float]]


WorkerCommand = LoadModel | UnloadModel | RemoteService


@dataclass(frozen=True, slots=True)
class WorkerView:
    hello: WorkerHello
    slots: tuple[SlotStatus, ...]


@dataclass(frozen=True, slots=True)
class QueueStats:
    model_id: str
    depth: int
    inflight: int
    expired: int
    overflowed: int
    granted: int
    superseded: int = 0
    dropped: int = 0  # queued requests of clients that disconnected
    credits: int = 0  # idle worker slots lent to gateways as dispatch credits


# ---- dispatch credits (credits.py): worker slots lent to a gateway --------------------


@dataclass(slots=True)  # its `running` and `revoked` change while it is lent
class Credit:
    """One worker slot for `model_id` lent to gateway session `session_id`."""

    credit_id: str
    session_id: int
    model_id: str
    worker_id: str
    data_endpoint: str
    generation: int
    request_ttl_ms: float
    local_queue: LocalQueueSpec | None = None  # the gateway may queue locally (a whole share)
    # The requests the gateway runs on it now: one, or more with calls staged behind it
    # (LocalQueue.stage) and urgent ones sent ahead of those.
    running: set[RequestKey] = field(default_factory=set)
    revoked: bool = False

    @property
    def slot_key(self) -> RequestKey:
        """The key the lent slot is held under in the worker registry."""
        return (CREDIT_SLOT_SESSION, self.credit_id)


@dataclass(frozen=True, slots=True)
class LocalQueueSpec:
    """How a gateway holding a model's whole share queues and ranks its own waiting requests
    for it: the scheduler's per-model strategy and the inputs of its keys (`LocalQueue` in
    scheduler.proto, docs/data-path.md)."""

    strategy: str
    terms: DeadlineTerms
    latency_budget_ms: float
    client_latency_budget_ms: Mapping[str, float]
    cadence_alpha: float
    max_queue_size: int
    reject_newest: bool
    tiers: tuple[int, ...] = ()  # tiered_deadline's
    stage: int = 0  # calls sent to a busy slot's worker behind the one running (the lookahead)
    policy: str = ""  # a registered policy of the deadline family (its module loaded by the gateway too)


@dataclass(slots=True)
class CreditRevoke:
    """Tell a gateway to stop using a credit and return it."""

    credit_id: str


@dataclass(slots=True)
class CreditRun:
    """A request the gateway already sent to a credit's worker."""

    credit_id: str
    info: RequestInfo


@dataclass(slots=True)
class FinishedRun:
    """A credit run the gateway reported only after it ended: the run and its outcome."""

    run: CreditRun
    completion: Completion


@dataclass(slots=True)
class RunTally:
    """Credit runs that ended before the gateway reported them and need nothing more: counted."""

    model_id: str
    worker_id: str
    runs: int
    failed: int = 0
    inference_ms: float = 0.0  # summed over the runs


# ---- what one gateway message carries ------------------------------------------------


@dataclass(frozen=True, slots=True)  # built once per gateway message, not per request
class Submission:
    """One batch from a gateway session (a SessionRequest), as the core takes it. Its parts
    apply in the order scheduler.proto gives: completes, finished, returns, runs, enqueues,
    cancels."""

    enqueues: Sequence[RequestInfo] = ()
    completes: Sequence[Completion] = ()
    cancels: Sequence[str] = ()
    runs: Sequence[CreditRun] = ()
    returns: Sequence[str] = ()
    finished: Sequence[FinishedRun] = ()
    # (model, requests waiting in the gateway's queue, its calls for the model since its last
    # report: call-seconds waiting there or running on its credits)
    local_depths: Sequence[tuple[str, int, float]] = ()
    tallies: Sequence[RunTally] = ()

    def __bool__(self) -> bool:
        return bool(
            self.enqueues
            or self.completes
            or self.cancels
            or self.runs
            or self.returns
            or self.finished
            or self.local_depths
            or self.tallies
        )
