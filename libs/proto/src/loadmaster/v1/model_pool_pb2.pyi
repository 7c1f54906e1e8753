from loadmaster.v1 import errors_pb2 as _errors_pb2
from loadmaster.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_STATE_UNSPECIFIED: _ClassVar[ModelState]
    MODEL_STATE_IDLE: _ClassVar[ModelState]
    MODEL_STATE_LOADING: _ClassVar[ModelState]
    MODEL_STATE_READY: _ClassVar[ModelState]
    MODEL_STATE_DRAINING: _ClassVar[ModelState]
    MODEL_STATE_UNLOADING: _ClassVar[ModelState]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]
MODEL_STATE_UNSPECIFIED: ModelState
MODEL_STATE_IDLE: ModelState
MODEL_STATE_LOADING: ModelState
MODEL_STATE_READY: ModelState
MODEL_STATE_DRAINING: ModelState
MODEL_STATE_UNLOADING: ModelState
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason

class InferRequest(_message.Message):
    __slots__ = ("request_id", "model_id", "inputs", "metadata", "deadline_unix_ns", "generation", "front_of_queue", "shm", "payload")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    FRONT_OF_QUEUE_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    inputs: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    metadata: _containers.ScalarMap[str, str]
    deadline_unix_ns: int
    generation: int
    front_of_queue: bool
    shm: ShmPayload
    payload: bytes
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., deadline_unix_ns: _Optional[int] = ..., generation: _Optional[int] = ..., front_of_queue: _Optional[bool] = ..., shm: _Optional[_Union[ShmPayload, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class ShmPayload(_message.Message):
    __slots__ = ("region", "offset", "size")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    region: str
    offset: int
    size: int
    def __init__(self, region: _Optional[str] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class InferResponse(_message.Message):
    __slots__ = ("request_id", "model_id", "outputs", "error_code", "error_message", "retryable", "inference_latency_ms", "queue_ms", "batch_size", "worker_id", "generation", "shm_unusable", "payload")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SHM_UNUSABLE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    outputs: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    error_code: _errors_pb2.ErrorCode
    error_message: str
    retryable: bool
    inference_latency_ms: float
    queue_ms: float
    batch_size: int
    worker_id: str
    generation: int
    shm_unusable: bool
    payload: bytes
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., retryable: _Optional[bool] = ..., inference_latency_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., worker_id: _Optional[str] = ..., generation: _Optional[int] = ..., shm_unusable: _Optional[bool] = ..., payload: _Optional[bytes] = ...) -> None: ...

class ModelSlotStatus(_message.Message):
    __slots__ = ("model_id", "state", "generation", "inflight", "max_inflight", "device", "vram_mb", "backend", "pinned", "last_used_unix_ms", "loaded_unix_ms", "load_time_ms", "error", "lease_id", "priority", "instances", "max_batch_size", "evictions", "reloads", "mb_per_gpu", "load_started_unix_ms")
    class MbPerGpuEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VRAM_MB_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LOADED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LOAD_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    RELOADS_FIELD_NUMBER: _ClassVar[int]
    MB_PER_GPU_FIELD_NUMBER: _ClassVar[int]
    LOAD_STARTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    state: ModelState
    generation: int
    inflight: int
    max_inflight: int
    device: str
    vram_mb: int
    backend: str
    pinned: bool
    last_used_unix_ms: int
    loaded_unix_ms: int
    load_time_ms: float
    error: str
    lease_id: str
    priority: int
    instances: int
    max_batch_size: int
    evictions: int
    reloads: int
    mb_per_gpu: _containers.ScalarMap[int, int]
    load_started_unix_ms: int
    def __init__(self, model_id: _Optional[str] = ..., state: _Optional[_Union[ModelState, str]] = ..., generation: _Optional[int] = ..., inflight: _Optional[int] = ..., max_inflight: _Optional[int] = ..., device: _Optional[str] = ..., vram_mb: _Optional[int] = ..., backend: _Optional[str] = ..., pinned: _Optional[bool] = ..., last_used_unix_ms: _Optional[int] = ..., loaded_unix_ms: _Optional[int] = ..., load_time_ms: _Optional[float] = ..., error: _Optional[str] = ..., lease_id: _Optional[str] = ..., priority: _Optional[int] = ..., instances: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., evictions: _Optional[int] = ..., reloads: _Optional[int] = ..., mb_per_gpu: _Optional[_Mapping[int, int]] = ..., load_started_unix_ms: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("model_id", "keep_alive_s")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_S_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    keep_alive_s: float
    def __init__(self, model_id: _Optional[str] = ..., keep_alive_s: _Optional[float] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: ModelSlotStatus
    def __init__(self, model: _Optional[_Union[ModelSlotStatus, _Mapping]] = ...) -> None: ...

class UnloadRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class UnloadResponse(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: ModelSlotStatus
    def __init__(self, model: _Optional[_Union[ModelSlotStatus, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("signatures_of",)
    SIGNATURES_OF_FIELD_NUMBER: _ClassVar[int]
    signatures_of: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, signatures_of: _Optional[_Iterable[str]] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "any_shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ANY_SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _tensor_pb2.Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    any_shape: bool
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_tensor_pb2.Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., any_shape: _Optional[bool] = ...) -> None: ...

class ModelSignature(_message.Message):
    __slots__ = ("model_id", "backend", "inputs", "outputs", "modality_config_json")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    MODALITY_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    backend: str
    inputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    outputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    modality_config_json: str
    def __init__(self, model_id: _Optional[str] = ..., backend: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., modality_config_json: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("worker_id", "data_endpoint", "models", "repository", "free_mb", "evictions", "leased_mb_per_gpu", "signatures")
    class EvictionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LeasedMbPerGpuEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    REPOSITORY_FIELD_NUMBER: _ClassVar[int]
    FREE_MB_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    LEASED_MB_PER_GPU_FIELD_NUMBER: _ClassVar[int]
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    data_endpoint: str
    models: _containers.RepeatedCompositeFieldContainer[ModelSlotStatus]
    repository: _containers.RepeatedScalarFieldContainer[str]
    free_mb: int
    evictions: _containers.ScalarMap[str, int]
    leased_mb_per_gpu: _containers.ScalarMap[int, int]
    signatures: _containers.RepeatedCompositeFieldContainer[ModelSignature]
    def __init__(self, worker_id: _Optional[str] = ..., data_endpoint: _Optional[str] = ..., models: _Optional[_Iterable[_Union[ModelSlotStatus, _Mapping]]] = ..., repository: _Optional[_Iterable[str]] = ..., free_mb: _Optional[int] = ..., evictions: _Optional[_Mapping[str, int]] = ..., leased_mb_per_gpu: _Optional[_Mapping[int, int]] = ..., signatures: _Optional[_Iterable[_Union[ModelSignature, _Mapping]]] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("model_id", "pinned")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    pinned: bool
    def __init__(self, model_id: _Optional[str] = ..., pinned: _Optional[bool] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: ModelSlotStatus
    def __init__(self, model: _Optional[_Union[ModelSlotStatus, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model_id", "prompt_token_ids", "prompt_text", "messages", "sampling", "deadline_unix_ns", "generation", "priority", "metadata", "response_format", "tenant", "tenant_weight", "chat_template_kwargs", "keep_alive_s", "tools", "logprobs", "n")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TENANT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_S_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    prompt_token_ids: PromptTokens
    prompt_text: str
    messages: ChatMessages
    sampling: SamplingParams
    deadline_unix_ns: int
    generation: int
    priority: int
    metadata: _containers.ScalarMap[str, str]
    response_format: ResponseFormat
    tenant: str
    tenant_weight: float
    chat_template_kwargs: str
    keep_alive_s: float
    tools: ToolUse
    logprobs: LogprobsRequest
    n: int
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[PromptTokens, _Mapping]] = ..., prompt_text: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., deadline_unix_ns: _Optional[int] = ..., generation: _Optional[int] = ..., priority: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., tenant: _Optional[str] = ..., tenant_weight: _Optional[float] = ..., chat_template_kwargs: _Optional[str] = ..., keep_alive_s: _Optional[float] = ..., tools: _Optional[_Union[ToolUse, _Mapping]] = ..., logprobs: _Optional[_Union[LogprobsRequest, _Mapping]] = ..., n: _Optional[int] = ...) -> None: ...

class FunctionTool(_message.Message):
    __slots__ = ("name", "description", "parameters_json", "strict")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    strict: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class ToolUse(_message.Message):
    __slots__ = ("functions", "choice", "function_name", "parallel")
    FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_NAME_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    functions: _containers.RepeatedCompositeFieldContainer[FunctionTool]
    choice: str
    function_name: str
    parallel: bool
    def __init__(self, functions: _Optional[_Iterable[_Union[FunctionTool, _Mapping]]] = ..., choice: _Optional[str] = ..., function_name: _Optional[str] = ..., parallel: _Optional[bool] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments", "index")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    index: int
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class LogprobsRequest(_message.Message):
    __slots__ = ("enabled", "top")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    top: int
    def __init__(self, enabled: _Optional[bool] = ..., top: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: bytes
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[bytes] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: bytes
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[bytes] = ..., logprob: _Optional[float] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("type", "json_schema", "name")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    type: str
    json_schema: str
    name: str
    def __init__(self, type: _Optional[str] = ..., json_schema: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class PromptTokens(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "images", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "seed", "stop")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerationUsage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("request_id", "model_id", "sequence", "chunk", "result", "error", "cancelled", "progress", "worker_id", "generation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    sequence: int
    chunk: TokenChunk
    result: GenerationResult
    error: GenerationError
    cancelled: GenerationCancelled
    progress: GenerationProgress
    worker_id: str
    generation: int
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., sequence: _Optional[int] = ..., chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., result: _Optional[_Union[GenerationResult, _Mapping]] = ..., error: _Optional[_Union[GenerationError, _Mapping]] = ..., cancelled: _Optional[_Union[GenerationCancelled, _Mapping]] = ..., progress: _Optional[_Union[GenerationProgress, _Mapping]] = ..., worker_id: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class GenerationProgress(_message.Message):
    __slots__ = ("queued_ahead", "loading", "load_fraction")
    QUEUED_AHEAD_FIELD_NUMBER: _ClassVar[int]
    LOADING_FIELD_NUMBER: _ClassVar[int]
    LOAD_FRACTION_FIELD_NUMBER: _ClassVar[int]
    queued_ahead: int
    loading: bool
    load_fraction: float
    def __init__(self, queued_ahead: _Optional[int] = ..., loading: _Optional[bool] = ..., load_fraction: _Optional[float] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text", "choice", "logprobs", "tool_calls")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    choice: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., choice: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class GenerationResult(_message.Message):
    __slots__ = ("finish_reason", "usage", "queue_ms", "time_to_first_token_ms", "preemptions", "choices")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    usage: GenerationUsage
    queue_ms: float
    time_to_first_token_ms: float
    preemptions: int
    choices: _containers.RepeatedCompositeFieldContainer[ChoiceEnd]
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[GenerationUsage, _Mapping]] = ..., queue_ms: _Optional[float] = ..., time_to_first_token_ms: _Optional[float] = ..., preemptions: _Optional[int] = ..., choices: _Optional[_Iterable[_Union[ChoiceEnd, _Mapping]]] = ...) -> None: ...

class ChoiceEnd(_message.Message):
    __slots__ = ("index", "finish_reason", "completion_tokens")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    index: int
    finish_reason: FinishReason
    completion_tokens: int
    def __init__(self, index: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class GenerationError(_message.Message):
    __slots__ = ("error_code", "error_message", "retryable", "usage")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    error_code: _errors_pb2.ErrorCode
    error_message: str
    retryable: bool
    usage: GenerationUsage
    def __init__(self, error_code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., error_message: _Optional[str] = ..., retryable: _Optional[bool] = ..., usage: _Optional[_Union[GenerationUsage, _Mapping]] = ...) -> None: ...

class GenerationCancelled(_message.Message):
    __slots__ = ("usage", "reason")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    usage: GenerationUsage
    reason: str
    def __init__(self, usage: _Optional[_Union[GenerationUsage, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class GenerateReplies(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[GenerateReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[GenerateReply, _Mapping]]] = ...) -> None: ...

class CancelGeneration(_message.Message):
    __slots__ = ("request_id", "model_id", "reason", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    reason: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., reason: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...
