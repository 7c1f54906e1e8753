from loadmaster.v1 import errors_pb2 as _errors_pb2
from loadmaster.v1 import model_pool_pb2 as _model_pool_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestInfo(_message.Message):
    __slots__ = ("request_id", "client_id", "model_id", "priority", "urgency", "steps_remaining", "received_unix_ns", "timeout_ms", "payload_bytes", "client_type", "trace_context", "credit_id", "affinity_key", "connection_bound")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    URGENCY_FIELD_NUMBER: _ClassVar[int]
    STEPS_REMAINING_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    CREDIT_ID_FIELD_NUMBER: _ClassVar[int]
    AFFINITY_KEY_FIELD_NUMBER: _ClassVar[int]
    CONNECTION_BOUND_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    client_id: str
    model_id: str
    priority: int
    urgency: float
    steps_remaining: int
    received_unix_ns: int
    timeout_ms: float
    payload_bytes: int
    client_type: str
    trace_context: _containers.ScalarMap[str, str]
    credit_id: str
    affinity_key: str
    connection_bound: bool
    def __init__(self, request_id: _Optional[str] = ..., client_id: _Optional[str] = ..., model_id: _Optional[str] = ..., priority: _Optional[int] = ..., urgency: _Optional[float] = ..., steps_remaining: _Optional[int] = ..., received_unix_ns: _Optional[int] = ..., timeout_ms: _Optional[float] = ..., payload_bytes: _Optional[int] = ..., client_type: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., credit_id: _Optional[str] = ..., affinity_key: _Optional[str] = ..., connection_bound: _Optional[bool] = ...) -> None: ...

class Complete(_message.Message):
    __slots__ = ("request_id", "error_code", "retryable", "worker_id", "inference_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    error_code: _errors_pb2.ErrorCode
    retryable: bool
    worker_id: str
    inference_ms: float
    def __init__(self, request_id: _Optional[str] = ..., error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., retryable: _Optional[bool] = ..., worker_id: _Optional[str] = ..., inference_ms: _Optional[float] = ...) -> None: ...

class SessionHello(_message.Message):
    __slots__ = ("gateway_id", "accepts_credits")
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_CREDITS_FIELD_NUMBER: _ClassVar[int]
    gateway_id: str
    accepts_credits: bool
    def __init__(self, gateway_id: _Optional[str] = ..., accepts_credits: _Optional[bool] = ...) -> None: ...

class FinishedRun(_message.Message):
    __slots__ = ("request", "complete")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    request: RequestInfo
    complete: Complete
    def __init__(self, request: _Optional[_Union[RequestInfo, _Mapping]] = ..., complete: _Optional[_Union[Complete, _Mapping]] = ...) -> None: ...

class RunTally(_message.Message):
    __slots__ = ("model_id", "worker_id", "runs", "failed", "inference_ms")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_MS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    worker_id: str
    runs: int
    failed: int
    inference_ms: float
    def __init__(self, model_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., runs: _Optional[int] = ..., failed: _Optional[int] = ..., inference_ms: _Optional[float] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("hello", "enqueue", "complete", "cancel", "return_credit", "finished_run", "local_queue_depth", "run_tally")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ENQUEUE_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    RETURN_CREDIT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_RUN_FIELD_NUMBER: _ClassVar[int]
    LOCAL_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    RUN_TALLY_FIELD_NUMBER: _ClassVar[int]
    hello: SessionHello
    enqueue: _containers.RepeatedCompositeFieldContainer[RequestInfo]
    complete: _containers.RepeatedCompositeFieldContainer[Complete]
    cancel: _containers.RepeatedScalarFieldContainer[str]
    return_credit: _containers.RepeatedScalarFieldContainer[str]
    finished_run: _containers.RepeatedCompositeFieldContainer[FinishedRun]
    local_queue_depth: _containers.RepeatedCompositeFieldContainer[LocalQueueDepth]
    run_tally: _containers.RepeatedCompositeFieldContainer[RunTally]
    def __init__(self, hello: _Optional[_Union[SessionHello, _Mapping]] = ..., enqueue: _Optional[_Iterable[_Union[RequestInfo, _Mapping]]] = ..., complete: _Optional[_Iterable[_Union[Complete, _Mapping]]] = ..., cancel: _Optional[_Iterable[str]] = ..., return_credit: _Optional[_Iterable[str]] = ..., finished_run: _Optional[_Iterable[_Union[FinishedRun, _Mapping]]] = ..., local_queue_depth: _Optional[_Iterable[_Union[LocalQueueDepth, _Mapping]]] = ..., run_tally: _Optional[_Iterable[_Union[RunTally, _Mapping]]] = ...) -> None: ...

class LocalQueueDepth(_message.Message):
    __slots__ = ("model_id", "waiting", "outstanding_s")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_S_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    waiting: int
    outstanding_s: float
    def __init__(self, model_id: _Optional[str] = ..., waiting: _Optional[int] = ..., outstanding_s: _Optional[float] = ...) -> None: ...

class Grant(_message.Message):
    __slots__ = ("request_id", "worker_id", "data_endpoint", "generation", "deadline_unix_ns", "attempt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    worker_id: str
    data_endpoint: str
    generation: int
    deadline_unix_ns: int
    attempt: int
    def __init__(self, request_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., data_endpoint: _Optional[str] = ..., generation: _Optional[int] = ..., deadline_unix_ns: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class Reject(_message.Message):
    __slots__ = ("request_id", "error_code", "message", "use_share")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    USE_SHARE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    error_code: _errors_pb2.ErrorCode
    message: str
    use_share: bool
    def __init__(self, request_id: _Optional[str] = ..., error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., message: _Optional[str] = ..., use_share: _Optional[bool] = ...) -> None: ...

class Credit(_message.Message):
    __slots__ = ("credit_id", "model_id", "worker_id", "data_endpoint", "generation", "request_ttl_ms", "local_queue")
    CREDIT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_QUEUE_FIELD_NUMBER: _ClassVar[int]
    credit_id: str
    model_id: str
    worker_id: str
    data_endpoint: str
    generation: int
    request_ttl_ms: float
    local_queue: LocalQueue
    def __init__(self, credit_id: _Optional[str] = ..., model_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., data_endpoint: _Optional[str] = ..., generation: _Optional[int] = ..., request_ttl_ms: _Optional[float] = ..., local_queue: _Optional[_Union[LocalQueue, _Mapping]] = ...) -> None: ...

class LocalQueue(_message.Message):
    __slots__ = ("strategy", "priority_step_ms", "urgency_weight", "steps_horizon", "service_ms", "latency_budget_ms", "client_latency_budget_ms", "cadence_alpha", "max_queue_size", "reject_newest", "tiers", "stage", "policy")
    class ClientLatencyBudgetMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    URGENCY_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    STEPS_HORIZON_FIELD_NUMBER: _ClassVar[int]
    SERVICE_MS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_LATENCY_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    CADENCE_ALPHA_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_SIZE_FIELD_NUMBER: _ClassVar[int]
    REJECT_NEWEST_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    strategy: str
    priority_step_ms: float
    urgency_weight: float
    steps_horizon: int
    service_ms: float
    latency_budget_ms: float
    client_latency_budget_ms: _containers.ScalarMap[str, float]
    cadence_alpha: float
    max_queue_size: int
    reject_newest: bool
    tiers: _containers.RepeatedScalarFieldContainer[int]
    stage: int
    policy: str
    def __init__(self, strategy: _Optional[str] = ..., priority_step_ms: _Optional[float] = ..., urgency_weight: _Optional[float] = ..., steps_horizon: _Optional[int] = ..., service_ms: _Optional[float] = ..., latency_budget_ms: _Optional[float] = ..., client_latency_budget_ms: _Optional[_Mapping[str, float]] = ..., cadence_alpha: _Optional[float] = ..., max_queue_size: _Optional[int] = ..., reject_newest: _Optional[bool] = ..., tiers: _Optional[_Iterable[int]] = ..., stage: _Optional[int] = ..., policy: _Optional[str] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("grants", "rejects", "credits", "revokes", "placements")
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    REJECTS_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    REVOKES_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    grants: _containers.RepeatedCompositeFieldContainer[Grant]
    rejects: _containers.RepeatedCompositeFieldContainer[Reject]
    credits: _containers.RepeatedCompositeFieldContainer[Credit]
    revokes: _containers.RepeatedScalarFieldContainer[str]
    placements: _containers.RepeatedCompositeFieldContainer[Placement]
    def __init__(self, grants: _Optional[_Iterable[_Union[Grant, _Mapping]]] = ..., rejects: _Optional[_Iterable[_Union[Reject, _Mapping]]] = ..., credits: _Optional[_Iterable[_Union[Credit, _Mapping]]] = ..., revokes: _Optional[_Iterable[str]] = ..., placements: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("model_id", "workers")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    workers: _containers.RepeatedCompositeFieldContainer[PlacedWorker]
    def __init__(self, model_id: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[PlacedWorker, _Mapping]]] = ...) -> None: ...

class PlacedWorker(_message.Message):
    __slots__ = ("worker_id", "data_endpoint", "generation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    data_endpoint: str
    generation: int
    def __init__(self, worker_id: _Optional[str] = ..., data_endpoint: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class WorkerHello(_message.Message):
    __slots__ = ("worker_id", "data_endpoint", "grpc_endpoint", "node", "repository")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    GRPC_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    REPOSITORY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    data_endpoint: str
    grpc_endpoint: str
    node: str
    repository: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., data_endpoint: _Optional[str] = ..., grpc_endpoint: _Optional[str] = ..., node: _Optional[str] = ..., repository: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkerReport(_message.Message):
    __slots__ = ("models", "free_mb")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    FREE_MB_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[_model_pool_pb2.ModelSlotStatus]
    free_mb: int
    def __init__(self, models: _Optional[_Iterable[_Union[_model_pool_pb2.ModelSlotStatus, _Mapping]]] = ..., free_mb: _Optional[int] = ...) -> None: ...

class WorkerSessionRequest(_message.Message):
    __slots__ = ("hello", "report", "tenant_service")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    TENANT_SERVICE_FIELD_NUMBER: _ClassVar[int]
    hello: WorkerHello
    report: WorkerReport
    tenant_service: TenantServices
    def __init__(self, hello: _Optional[_Union[WorkerHello, _Mapping]] = ..., report: _Optional[_Union[WorkerReport, _Mapping]] = ..., tenant_service: _Optional[_Union[TenantServices, _Mapping]] = ...) -> None: ...

class TenantService(_message.Message):
    __slots__ = ("model_id", "service")
    class ServiceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    service: _containers.ScalarMap[str, float]
    def __init__(self, model_id: _Optional[str] = ..., service: _Optional[_Mapping[str, float]] = ...) -> None: ...

class TenantServices(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[TenantService]
    def __init__(self, models: _Optional[_Iterable[_Union[TenantService, _Mapping]]] = ...) -> None: ...

class WorkerSessionResponse(_message.Message):
    __slots__ = ("load", "unload", "remote_service")
    LOAD_FIELD_NUMBER: _ClassVar[int]
    UNLOAD_FIELD_NUMBER: _ClassVar[int]
    REMOTE_SERVICE_FIELD_NUMBER: _ClassVar[int]
    load: str
    unload: str
    remote_service: TenantServices
    def __init__(self, load: _Optional[str] = ..., unload: _Optional[str] = ..., remote_service: _Optional[_Union[TenantServices, _Mapping]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "data_endpoint", "grpc_endpoint", "node", "repository", "models")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    GRPC_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    REPOSITORY_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    data_endpoint: str
    grpc_endpoint: str
    node: str
    repository: _containers.RepeatedScalarFieldContainer[str]
    models: _containers.RepeatedCompositeFieldContainer[_model_pool_pb2.ModelSlotStatus]
    def __init__(self, worker_id: _Optional[str] = ..., data_endpoint: _Optional[str] = ..., grpc_endpoint: _Optional[str] = ..., node: _Optional[str] = ..., repository: _Optional[_Iterable[str]] = ..., models: _Optional[_Iterable[_Union[_model_pool_pb2.ModelSlotStatus, _Mapping]]] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class GetQueuesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class QueueInfo(_message.Message):
    __slots__ = ("model_id", "depth", "inflight", "expired", "overflowed", "granted", "superseded", "dropped", "credits")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    OVERFLOWED_FIELD_NUMBER: _ClassVar[int]
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    depth: int
    inflight: int
    expired: int
    overflowed: int
    granted: int
    superseded: int
    dropped: int
    credits: int
    def __init__(self, model_id: _Optional[str] = ..., depth: _Optional[int] = ..., inflight: _Optional[int] = ..., expired: _Optional[int] = ..., overflowed: _Optional[int] = ..., granted: _Optional[int] = ..., superseded: _Optional[int] = ..., dropped: _Optional[int] = ..., credits: _Optional[int] = ...) -> None: ...

class GetQueuesResponse(_message.Message):
    __slots__ = ("queues", "strategy", "policy", "active_clients")
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    queues: _containers.RepeatedCompositeFieldContainer[QueueInfo]
    strategy: str
    policy: str
    active_clients: int
    def __init__(self, queues: _Optional[_Iterable[_Union[QueueInfo, _Mapping]]] = ..., strategy: _Optional[str] = ..., policy: _Optional[str] = ..., active_clients: _Optional[int] = ...) -> None: ...

class SetStrategyRequest(_message.Message):
    __slots__ = ("strategy", "policy")
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    strategy: str
    policy: str
    def __init__(self, strategy: _Optional[str] = ..., policy: _Optional[str] = ...) -> None: ...

class SetStrategyResponse(_message.Message):
    __slots__ = ("strategy", "previous", "moved")
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    strategy: str
    previous: str
    moved: int
    def __init__(self, strategy: _Optional[str] = ..., previous: _Optional[str] = ..., moved: _Optional[int] = ...) -> None: ...
