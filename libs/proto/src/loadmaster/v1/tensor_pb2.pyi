from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
    BOOL: _ClassVar[DType]
    BYTES: _ClassVar[DType]

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_UNSPECIFIED: _ClassVar[Encoding]
    RAW: _ClassVar[Encoding]
    JPEG: _ClassVar[Encoding]
    PNG: _ClassVar[Encoding]
DTYPE_UNSPECIFIED: DType
FLOAT16: DType
FLOAT32: DType
FLOAT64: DType
BFLOAT16: DType
UINT8: DType
INT32: DType
INT64: DType
BOOL: DType
BYTES: DType
ENCODING_UNSPECIFIED: Encoding
RAW: Encoding
JPEG: Encoding
PNG: Encoding

class Tensor(_message.Message):
    __slots__ = ("key", "dtype", "shape", "byte_offset", "byte_length", "timestamp_ns", "encoding")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    key: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    byte_offset: int
    byte_length: int
    timestamp_ns: int
    encoding: Encoding
    def __init__(self, key: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., byte_offset: _Optional[int] = ..., byte_length: _Optional[int] = ..., timestamp_ns: _Optional[int] = ..., encoding: _Optional[_Union[Encoding, str]] = ...) -> None: ...
