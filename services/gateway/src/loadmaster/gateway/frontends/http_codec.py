"""KServe v2 HTTP bodies <-> `KServeInput` / `KServeOutput` (pure; no sockets).

A request body is a JSON header, optionally followed by binary tensor data (the
binary-data extension: the header's length is in `Inference-Header-Content-Length`
and each binary input names its `binary_data_size`). Responses use binary data for
the outputs that ask for it (`binary_data`, or `binary_data_output` for all).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.common.gateway_config import LimitsSettings
from loadmaster.common.tensors import deserialize_bytes, serialize_bytes
from loadmaster.gateway.kserve_calls import KServeInput, KServeOutput, numpy_for

__all__ = [
    "HEADER_LENGTH",
    "InferBody",
    "ParsedInfer",
    "encode_response",
    "encode_response_parts",
    "json_encoding_bytes",
    "parse_infer",
]

HEADER_LENGTH = "inference-header-content-length"


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputBody(_Body):
    name: str = Field(min_length=1)
    shape: list[StrictInt]
    datatype: str
    parameters: dict[str, Any] = Field(default_factory=dict)
    data: Any = None


class OutputBody(_Body):
    name: str = Field(min_length=1)
    parameters: dict[str, Any] = Field(default_factory=dict)


class InferBody(_Body):
    id: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)
    inputs: list[InputBody]
    outputs: list[OutputBody] = Field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ParsedInfer:
    id: str
    parameters: dict[str, Any]
    inputs: list[KServeInput]
    outputs: dict[str, bool]  # requested output -> as binary data
    binary_default: bool


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "body"
    return f"request body: {where}: {first['msg']}"


# What JSON values each datatype takes, exactly: nothing is coerced ("false" is no BOOL, 1.5 no
# INT32, null no FP32), as in Triton, whose JSON reader checks each value's JSON type.
_JSON_KINDS: dict[str, tuple[frozenset[type], str]] = {
    "BOOL": (frozenset({bool}), "a JSON boolean"),
    "UINT8": (frozenset({int}), "a JSON integer"),
    "INT32": (frozenset({int}), "a JSON integer"),
    "INT64": (frozenset({int}), "a JSON integer"),
    "FP16": (frozenset({int, float}), "a JSON number"),
    "FP32": (frozenset({int, float}), "a JSON number"),
    "FP64": (frozenset({int, float}), "a JSON number"),
    "BYTES": (frozenset({str}), "a JSON string"),
}


def _json_values(tensor: InputBody, limits: LimitsSettings | None) -> list[Any]:
    """The tensor's `data`, flattened in row-major order, each value of the datatype's JSON kind."""
    flat: list[Any] = np.asarray(tensor.data, dtype=object).reshape(-1).tolist()
    if tensor.datatype == "BYTES" and limits is not None and len(flat) > limits.max_bytes_elements:
        raise InvalidArgumentError(
            f"tensor '{tensor.name}': {len(flat)} BYTES elements exceed the limit of {limits.max_bytes_elements}"
        )
    allowed, kind = _JSON_KINDS[tensor.datatype]
    if not set(map(type, flat)) <= allowed:
        fits = np.fromiter(map(allowed.__contains__, map(type, flat)), dtype=bool, count=len(flat))
        index = int(np.argmin(fits))
        shown = json.dumps(flat[index]) if not isinstance(flat[index], list) else "a nested list"
        raise InvalidArgumentError(
            f"tensor '{tensor.name}': data[{index}] is {shown[:40]}, not {kind} ({tensor.datatype})"
        )
    expected = math.prod(tensor.shape) if all(d >= 0 for d in tensor.shape) else -1
    if len(flat) != expected:
        raise InvalidArgumentError(
            f"tensor '{tensor.name}': {len(flat)} elements in data for shape {tensor.shape}"
        )
    return flat


def _json_bytes(tensor: InputBody, limits: LimitsSettings | None = None) -> bytes:
    dtype = numpy_for(tensor.name, tensor.datatype)
    if tensor.datatype == "BF16":
        raise InvalidArgumentError(f"tensor '{tensor.name}': BF16 data must be sent as binary data")
    if tensor.data is None:
        raise InvalidArgumentError(f"tensor '{tensor.name}': no data and no binary_data_size")
    values = _json_values(tensor, limits)
    if tensor.datatype == "BYTES":  # JSON strings, sent as UTF-8
        return serialize_bytes(np.asarray(values, dtype=object))
    if dtype.kind in "iu":
        try:
            wide = np.asarray(values, dtype=np.int64)
        except OverflowError:
            wide = None
        info = np.iinfo(dtype)
        if wide is None or (wide.size and (wide.min() < info.min or wide.max() > info.max)):
            raise InvalidArgumentError(
                f"tensor '{tensor.name}': a value is out of range for {tensor.datatype}"
            )
        return wide.astype(dtype).tobytes()
    return np.asarray(values, dtype=dtype).tobytes()


def parse_infer(
    body: bytes | memoryview, header_length: str | None, limits: LimitsSettings | None = None
) -> ParsedInfer:
    """Split and check an infer request body; errors are `InvalidArgumentError` naming the problem.

    Costs time in proportion to the JSON part: callers run large bodies off the event loop."""
    binary = memoryview(b"")
    json_part: bytes | memoryview = body
    if header_length is not None:
        try:
            length = int(header_length)
        except ValueError:
            raise InvalidArgumentError("Inference-Header-Content-Length is not an integer") from None
        if not 0 <= length <= len(body):
            raise InvalidArgumentError(
                f"Inference-Header-Content-Length {length} is outside the {len(body)}-byte body"
            )
        json_part, binary = memoryview(body)[:length], memoryview(body)[length:]
    if limits is not None and len(json_part) > limits.max_json_bytes:
        raise InvalidArgumentError(
            f"JSON request body of {len(json_part)} bytes exceeds the limit of {limits.max_json_bytes} "
            "(send large tensors as binary data)"
        )
    try:
        raw = json.loads(bytes(json_part))
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise InvalidArgumentError(f"request body is not JSON: {type(error).__name__}") from None
    try:
        parsed = InferBody.model_validate(raw)
    except ValidationError as error:
        raise InvalidArgumentError(_describe(error)) from None
    inputs: list[KServeInput] = []
    offset = 0
    for tensor in parsed.inputs:
        size = tensor.parameters.get("binary_data_size")
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise InvalidArgumentError(
                    f"tensor '{tensor.name}': binary_data_size must be a non-negative integer"
                )
            if offset + size > len(binary):
                raise InvalidArgumentError(
                    f"tensor '{tensor.name}': binary_data_size {size} runs past the binary data "
                    f"({len(binary) - offset} bytes left)"
                )
            data: bytes | memoryview = binary[offset : offset + size]
            offset += size
        else:
            data = _json_bytes(tensor, limits)
        inputs.append(KServeInput(tensor.name, tensor.datatype, tuple(tensor.shape), data))
    if offset != len(binary):
        raise InvalidArgumentError(f"{len(binary) - offset} bytes of binary data belong to no input")
    binary_default = bool(parsed.parameters.get("binary_data_output", False))
    outputs = {o.name: bool(o.parameters.get("binary_data", binary_default)) for o in parsed.outputs}
    return ParsedInfer(parsed.id, parsed.parameters, inputs, outputs, binary_default)


def encode_response(
    *,
    model_name: str,
    request_id: str,
    outputs: Sequence[KServeOutput],
    binary: dict[str, bool],
    binary_default: bool,
) -> tuple[bytes, int | None]:
    """The response body and, when it carries binary data, the JSON header's length."""
    head, blobs = encode_response_parts(
        model_name=model_name,
        request_id=request_id,
        outputs=outputs,
        binary=binary,
        binary_default=binary_default,
    )
    if not blobs:
        return head, None
    return b"".join([head, *blobs]), len(head)


def json_encoding_bytes(
    outputs: Sequence[KServeOutput], binary: dict[str, bool], binary_default: bool
) -> int:
    """How many output bytes the response carries as JSON values (what its encoding costs grows with)."""
    return sum(
        len(output.data)
        for output in outputs
        if not (binary.get(output.name, binary_default) or output.datatype == "BF16")
    )


def encode_response_parts(
    *,
    model_name: str,
    request_id: str,
    outputs: Sequence[KServeOutput],
    binary: dict[str, bool],
    binary_default: bool,
) -> tuple[bytes, list[memoryview]]:
    """The response's JSON header and the binary data that follows it, as views of the outputs
    (no copy): a caller sends them one after the other. Costs time in proportion to the
    outputs sent as JSON (`json_encoding_bytes`), none for binary data."""
    entries: list[dict[str, Any]] = []
    blobs: list[memoryview] = []
    for output in outputs:
        entry: dict[str, Any] = {
            "name": output.name,
            "datatype": output.datatype,
            "shape": list(output.shape),
        }
        as_binary = binary.get(output.name, binary_default) or output.datatype == "BF16"
        if as_binary:
            entry["parameters"] = {"binary_data_size": len(output.data)}
            blobs.append(memoryview(output.data).cast("B"))
        elif output.datatype == "BYTES":
            count = math.prod(output.shape)
            elements = deserialize_bytes(output.data, count, name=output.name)
            entry["data"] = [element.decode("utf-8", errors="replace") for element in elements]
        else:
            values = np.frombuffer(output.data, dtype=numpy_for(output.name, output.datatype))
            if values.dtype.kind == "f" and not np.isfinite(values).all():
                # JSON has no NaN or Infinity (Triton's JSON writer refuses them too): binary data does.
                raise InvalidArgumentError(
                    f"output '{output.name}' holds NaN or Infinity, which JSON cannot carry: "
                    'ask for it as binary data ("parameters": {"binary_data": true})'
                )
            entry["data"] = values.tolist()
        entries.append(entry)
    header: dict[str, Any] = {"model_name": model_name, "model_version": "1", "outputs": entries}
    if request_id:
        header["id"] = request_id
    return json.dumps(header, separators=(",", ":"), allow_nan=False).encode(), blobs
