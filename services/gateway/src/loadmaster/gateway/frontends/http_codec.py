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
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.common.tensors import deserialize_bytes, serialize_bytes
from loadmaster.gateway.frontends.kserve import KServeInput, KServeOutput, numpy_for

__all__ = ["HEADER_LENGTH", "InferBody", "ParsedInfer", "encode_response", "parse_infer"]

HEADER_LENGTH = "inference-header-content-length"


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputBody(_Body):
    name: str = Field(min_length=1)
    shape: list[int]
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


def _json_bytes(tensor: InputBody) -> bytes:
    dtype = numpy_for(tensor.name, tensor.datatype)
    if tensor.datatype == "BF16":
        raise InvalidArgumentError(f"tensor '{tensor.name}': BF16 data must be sent as binary data")
    if tensor.data is None:
        raise InvalidArgumentError(f"tensor '{tensor.name}': no data and no binary_data_size")
    if tensor.datatype == "BYTES":  # JSON strings (UTF-8) or lists of them
        elements = np.asarray(tensor.data, dtype=object).reshape(-1)
        if not all(isinstance(element, str) for element in elements):
            raise InvalidArgumentError(f"tensor '{tensor.name}': BYTES data must be JSON strings")
        expected = math.prod(tensor.shape) if all(d >= 0 for d in tensor.shape) else -1
        if elements.size != expected:
            raise InvalidArgumentError(
                f"tensor '{tensor.name}': {elements.size} elements in data for shape {tensor.shape}"
            )
        return serialize_bytes(elements)
    try:
        array = np.asarray(tensor.data, dtype=dtype)
    except (ValueError, TypeError, OverflowError) as error:
        raise InvalidArgumentError(
            f"tensor '{tensor.name}': data is not {tensor.datatype}: {error}"
        ) from None
    expected = math.prod(tensor.shape) if all(d >= 0 for d in tensor.shape) else -1
    if array.size != expected:
        raise InvalidArgumentError(
            f"tensor '{tensor.name}': {array.size} elements in data for shape {tensor.shape}"
        )
    return array.tobytes()


def parse_infer(body: bytes, header_length: str | None) -> ParsedInfer:
    """Split and check an infer request body; errors are `InvalidArgumentError` naming the problem."""
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
            data = _json_bytes(tensor)
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
    entries: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for output in outputs:
        entry: dict[str, Any] = {
            "name": output.name,
            "datatype": output.datatype,
            "shape": list(output.shape),
        }
        as_binary = binary.get(output.name, binary_default) or output.datatype == "BF16"
        if as_binary:
            entry["parameters"] = {"binary_data_size": len(output.data)}
            blobs.append(bytes(output.data))
        elif output.datatype == "BYTES":
            count = math.prod(output.shape)
            elements = deserialize_bytes(output.data, count, name=output.name)
            entry["data"] = [element.decode("utf-8", errors="replace") for element in elements]
        else:
            dtype = numpy_for(output.name, output.datatype)
            entry["data"] = np.frombuffer(output.data, dtype=dtype).tolist()
        entries.append(entry)
    header: dict[str, Any] = {"model_name": model_name, "model_version": "1", "outputs": entries}
    if request_id:
        header["id"] = request_id
    head = json.dumps(header, separators=(",", ":")).encode()
    if not blobs:
        return head, None
    return head + b"".join(blobs), len(head)
