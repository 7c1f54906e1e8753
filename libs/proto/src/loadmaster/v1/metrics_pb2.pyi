from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sample(_message.Message):
    __slots__ = ("name", "value", "labels", "timestamp_unix_ns")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: float
    labels: _containers.ScalarMap[str, str]
    timestamp_unix_ns: int
    def __init__(self, name: _Optional[str] = ..., value: _Optional[float] = ..., labels: _Optional[_Mapping[str, str]] = ..., timestamp_unix_ns: _Optional[int] = ...) -> None: ...

class SampleSeries(_message.Message):
    __slots__ = ("name", "labels", "values", "timestamp_deltas_ns")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_DELTAS_NS_FIELD_NUMBER: _ClassVar[int]
    name: str
    labels: _containers.ScalarMap[str, str]
    values: _containers.RepeatedScalarFieldContainer[float]
    timestamp_deltas_ns: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., values: _Optional[_Iterable[float]] = ..., timestamp_deltas_ns: _Optional[_Iterable[int]] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("service", "instance", "samples", "series")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SERIES_FIELD_NUMBER: _ClassVar[int]
    service: str
    instance: str
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    series: _containers.RepeatedCompositeFieldContainer[SampleSeries]
    def __init__(self, service: _Optional[str] = ..., instance: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., series: _Optional[_Iterable[_Union[SampleSeries, _Mapping]]] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("count", "mean", "min", "p50", "p95", "p99", "max", "sum")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    P50_FIELD_NUMBER: _ClassVar[int]
    P95_FIELD_NUMBER: _ClassVar[int]
    P99_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    count: int
    mean: float
    min: float
    p50: float
    p95: float
    p99: float
    max: float
    sum: float
    def __init__(self, count: _Optional[int] = ..., mean: _Optional[float] = ..., min: _Optional[float] = ..., p50: _Optional[float] = ..., p95: _Optional[float] = ..., p99: _Optional[float] = ..., max: _Optional[float] = ..., sum: _Optional[float] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("name", "labels", "window_s")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    labels: _containers.ScalarMap[str, str]
    window_s: float
    def __init__(self, name: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., window_s: _Optional[float] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: Stats
    def __init__(self, stats: _Optional[_Union[Stats, _Mapping]] = ...) -> None: ...

class GetLatestRequest(_message.Message):
    __slots__ = ("name", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    name: str
    labels: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GetLatestResponse(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    def __init__(self, samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ...) -> None: ...

class MetricsServiceWatchResponse(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    def __init__(self, samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ...) -> None: ...

class MetricsServiceWatchRequest(_message.Message):
    __slots__ = ("names", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAMES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    labels: _containers.ScalarMap[str, str]
    def __init__(self, names: _Optional[_Iterable[str]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GetModelStatisticsRequest(_message.Message):
    __slots__ = ("model_id", "window_s")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    window_s: float
    def __init__(self, model_id: _Optional[str] = ..., window_s: _Optional[float] = ...) -> None: ...

class DurationTotal(_message.Message):
    __slots__ = ("count", "total_ms")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    count: int
    total_ms: float
    def __init__(self, count: _Optional[int] = ..., total_ms: _Optional[float] = ...) -> None: ...

class BatchStatistics(_message.Message):
    __slots__ = ("batch_size", "count")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    count: int
    def __init__(self, batch_size: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class ModelStatistics(_message.Message):
    __slots__ = ("model_id", "success_count", "failure_count", "failures_by_code", "success", "failure", "queue", "compute", "inference_count", "execution_count", "batch_stats", "last_inference_unix_ns")
    class FailuresByCodeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_COUNT_FIELD_NUMBER: _ClassVar[int]
    FAILURE_COUNT_FIELD_NUMBER: _ClassVar[int]
    FAILURES_BY_CODE_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_COUNT_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_COUNT_FIELD_NUMBER: _ClassVar[int]
    BATCH_STATS_FIELD_NUMBER: _ClassVar[int]
    LAST_INFERENCE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    success_count: int
    failure_count: int
    failures_by_code: _containers.ScalarMap[str, int]
    success: DurationTotal
    failure: DurationTotal
    queue: DurationTotal
    compute: DurationTotal
    inference_count: int
    execution_count: int
    batch_stats: _containers.RepeatedCompositeFieldContainer[BatchStatistics]
    last_inference_unix_ns: int
    def __init__(self, model_id: _Optional[str] = ..., success_count: _Optional[int] = ..., failure_count: _Optional[int] = ..., failures_by_code: _Optional[_Mapping[str, int]] = ..., success: _Optional[_Union[DurationTotal, _Mapping]] = ..., failure: _Optional[_Union[DurationTotal, _Mapping]] = ..., queue: _Optional[_Union[DurationTotal, _Mapping]] = ..., compute: _Optional[_Union[DurationTotal, _Mapping]] = ..., inference_count: _Optional[int] = ..., execution_count: _Optional[int] = ..., batch_stats: _Optional[_Iterable[_Union[BatchStatistics, _Mapping]]] = ..., last_inference_unix_ns: _Optional[int] = ...) -> None: ...

class GetModelStatisticsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelStatistics]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelStatistics, _Mapping]]] = ...) -> None: ...
