from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_FLOAT16: _ClassVar[Dtype]
    DTYPE_FLOAT32: _ClassVar[Dtype]
    DTYPE_FLOAT64: _ClassVar[Dtype]
    DTYPE_BFLOAT16: _ClassVar[Dtype]
    DTYPE_UINT8: _ClassVar[Dtype]
    DTYPE_INT32: _ClassVar[Dtype]
    DTYPE_INT64: _ClassVar[Dtype]
    DTYPE_BOOL: _ClassVar[Dtype]
    DTYPE_BYTES: _ClassVar[Dtype]

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_UNSPECIFIED: _ClassVar[Encoding]
    ENCODING_RAW: _ClassVar[Encoding]
    ENCODING_JPEG: _ClassVar[Encoding]
    ENCODING_PNG: _ClassVar[Encoding]
DTYPE_UNSPECIFIED: Dtype
DTYPE_FLOAT16: Dtype
DTYPE_FLOAT32: Dtype
DTYPE_FLOAT64: Dtype
DTYPE_BFLOAT16: Dtype
DTYPE_UINT8: Dtype
DTYPE_INT32: Dtype
DTYPE_INT64: Dtype
DTYPE_BOOL: Dtype
DTYPE_BYTES: Dtype
ENCODING_UNSPECIFIED: Encoding
ENCODING_RAW: Encoding
ENCODING_JPEG: Encoding
ENCODING_PNG: Encoding

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
    dtype: Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    byte_offset: int
    byte_length: int
    timestamp_ns: int
    encoding: Encoding
    def __init__(self, key: _Optional[str] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., byte_offset: _Optional[int] = ..., byte_length: _Optional[int] = ..., timestamp_ns: _Optional[int] = ..., encoding: _Optional[_Union[Encoding, str]] = ...) -> None: ...
