from loadmaster.v1 import errors_pb2 as _errors_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Gpu(_message.Message):
    __slots__ = ("node", "index", "uuid", "name", "total_mb", "reserve_mb", "used_outside_mb", "leased_mb", "free_mb")
    NODE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MB_FIELD_NUMBER: _ClassVar[int]
    RESERVE_MB_FIELD_NUMBER: _ClassVar[int]
    USED_OUTSIDE_MB_FIELD_NUMBER: _ClassVar[int]
    LEASED_MB_FIELD_NUMBER: _ClassVar[int]
    FREE_MB_FIELD_NUMBER: _ClassVar[int]
    node: str
    index: int
    uuid: str
    name: str
    total_mb: int
    reserve_mb: int
    used_outside_mb: int
    leased_mb: int
    free_mb: int
    def __init__(self, node: _Optional[str] = ..., index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., total_mb: _Optional[int] = ..., reserve_mb: _Optional[int] = ..., used_outside_mb: _Optional[int] = ..., leased_mb: _Optional[int] = ..., free_mb: _Optional[int] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "holder", "node", "mb_per_gpu", "labels", "created_unix_ms", "expires_unix_ms", "fencing_token")
    class MbPerGpuEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    MB_PER_GPU_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    holder: str
    node: str
    mb_per_gpu: _containers.ScalarMap[int, int]
    labels: _containers.ScalarMap[str, str]
    created_unix_ms: int
    expires_unix_ms: int
    fencing_token: int
    def __init__(self, lease_id: _Optional[str] = ..., holder: _Optional[str] = ..., node: _Optional[str] = ..., mb_per_gpu: _Optional[_Mapping[int, int]] = ..., labels: _Optional[_Mapping[str, str]] = ..., created_unix_ms: _Optional[int] = ..., expires_unix_ms: _Optional[int] = ..., fencing_token: _Optional[int] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node", "gpus")
    NODE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    node: str
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    def __init__(self, node: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("gpus",)
    GPUS_FIELD_NUMBER: _ClassVar[int]
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    def __init__(self, gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("client_request_id", "holder", "node", "mb", "gpus", "allow_split", "ttl_s", "labels", "wait_s", "priority")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    MB_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_SPLIT_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    client_request_id: str
    holder: str
    node: str
    mb: int
    gpus: _containers.RepeatedScalarFieldContainer[int]
    allow_split: bool
    ttl_s: float
    labels: _containers.ScalarMap[str, str]
    wait_s: float
    priority: int
    def __init__(self, client_request_id: _Optional[str] = ..., holder: _Optional[str] = ..., node: _Optional[str] = ..., mb: _Optional[int] = ..., gpus: _Optional[_Iterable[int]] = ..., allow_split: _Optional[bool] = ..., ttl_s: _Optional[float] = ..., labels: _Optional[_Mapping[str, str]] = ..., wait_s: _Optional[float] = ..., priority: _Optional[int] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("lease_id", "fencing_token", "ttl_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    fencing_token: int
    ttl_s: float
    def __init__(self, lease_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class RenewManyRequest(_message.Message):
    __slots__ = ("renewals",)
    RENEWALS_FIELD_NUMBER: _ClassVar[int]
    renewals: _containers.RepeatedCompositeFieldContainer[RenewRequest]
    def __init__(self, renewals: _Optional[_Iterable[_Union[RenewRequest, _Mapping]]] = ...) -> None: ...

class RenewManyResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RenewResult]
    def __init__(self, results: _Optional[_Iterable[_Union[RenewResult, _Mapping]]] = ...) -> None: ...

class RenewResult(_message.Message):
    __slots__ = ("lease", "error")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    error: LeaseOpError
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., error: _Optional[_Union[LeaseOpError, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "fencing_token")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    fencing_token: int
    def __init__(self, lease_id: _Optional[str] = ..., fencing_token: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class LeaseOpError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: _errors_pb2.ErrorCode
    message: str
    def __init__(self, code: _Optional[_Union[_errors_pb2.ErrorCode, str]] = ..., message: _Optional[str] = ...) -> None: ...

class ListLeasesRequest(_message.Message):
    __slots__ = ("node", "holder")
    NODE_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    node: str
    holder: str
    def __init__(self, node: _Optional[str] = ..., holder: _Optional[str] = ...) -> None: ...

class ListLeasesResponse(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    def __init__(self, leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ...) -> None: ...

class InventoryRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class InventoryResponse(_message.Message):
    __slots__ = ("gpus",)
    GPUS_FIELD_NUMBER: _ClassVar[int]
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    def __init__(self, gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchResponse(_message.Message):
    __slots__ = ("kind", "lease", "timestamp_unix_ms")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[WatchResponse.Kind]
        KIND_ACQUIRED: _ClassVar[WatchResponse.Kind]
        KIND_RENEWED: _ClassVar[WatchResponse.Kind]
        KIND_RELEASED: _ClassVar[WatchResponse.Kind]
        KIND_EXPIRED: _ClassVar[WatchResponse.Kind]
    KIND_UNSPECIFIED: WatchResponse.Kind
    KIND_ACQUIRED: WatchResponse.Kind
    KIND_RENEWED: WatchResponse.Kind
    KIND_RELEASED: WatchResponse.Kind
    KIND_EXPIRED: WatchResponse.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    kind: WatchResponse.Kind
    lease: Lease
    timestamp_unix_ms: int
    def __init__(self, kind: _Optional[_Union[WatchResponse.Kind, str]] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., timestamp_unix_ms: _Optional[int] = ...) -> None: ...
