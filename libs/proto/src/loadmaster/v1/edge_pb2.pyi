from loadmaster.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Client(_message.Message):
    __slots__ = ("id", "type")
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    id: str
    type: str
    def __init__(self, id: _Optional[str] = ..., type: _Optional[str] = ...) -> None: ...

class Observation(_message.Message):
    __slots__ = ("client", "timestamp_ns", "urgency", "tensors", "model_id", "steps_remaining", "metadata", "priority")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    URGENCY_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    STEPS_REMAINING_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    client: Client
    timestamp_ns: int
    urgency: float
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    model_id: str
    steps_remaining: int
    metadata: _containers.ScalarMap[str, str]
    priority: int
    def __init__(self, client: _Optional[_Union[Client, _Mapping]] = ..., timestamp_ns: _Optional[int] = ..., urgency: _Optional[float] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., model_id: _Optional[str] = ..., steps_remaining: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., priority: _Optional[int] = ...) -> None: ...

class ModelResponse(_message.Message):
    __slots__ = ("client", "response_id", "timestamp_ns", "tensors", "inference_latency_ms", "model_id", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    client: Client
    response_id: str
    timestamp_ns: int
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    inference_latency_ms: float
    model_id: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, client: _Optional[_Union[Client, _Mapping]] = ..., response_id: _Optional[str] = ..., timestamp_ns: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., inference_latency_ms: _Optional[float] = ..., model_id: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...
