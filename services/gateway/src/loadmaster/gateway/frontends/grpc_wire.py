"""A large `ModelInferRequest` read, and a large `ModelInferResponse` written, without copying
their tensor data.

protobuf copies every bytes field it parses, and again each time one is read: for a 64 MiB
request that is two more 64 MiB copies, each holding the interpreter for 60-100 ms on a busy
2-core machine (and `ByteSize()` re-encodes the message: 300+ ms). Those stalled every other
client of the gateway. So for a large message, the top level is walked (a handful of fields:
names, parameters, tensor metadata, the data entries), the `raw_input_contents` entries (field
7) become views into the received bytes, and protobuf parses only the rest, which is small.
Anything unusual at the top level (an unknown wire type, a length past the end, very many
fields) falls back to protobuf's own parse, which then decides.

The other way, a reply with large outputs is encoded by protobuf without its
`raw_output_contents`, and the outputs are appended as field 6 entries (repeated fields may
come in any order on the wire): parts to be joined or written where the copy costs no loop
time (`encode_infer_response`).
"""

from __future__ import annotations

from dataclasses import dataclass

from loadmaster.gateway.kserve_protocol import inference_pb2

__all__ = ["LARGE_MESSAGE_BYTES", "LargeInferRequest", "encode_infer_response", "split_infer_request"]

LARGE_MESSAGE_BYTES = 1 << 20  # messages above this size are split rather than parsed whole
_RAW_INPUT_CONTENTS = 7  # ModelInferRequest.raw_input_contents
_RAW_OUTPUT_CONTENTS = 6  # ModelInferResponse.raw_output_contents
_INFER_RESPONSE = 2  # ModelStreamInferResponse.infer_response
_LENGTH_DELIMITED = 2
_MAX_TOP_FIELDS = 4096  # a real request has a few per tensor


@dataclass(frozen=True, slots=True)
class LargeInferRequest:
    """A `ModelInferRequest` whose `raw_input_contents` are views into the bytes received."""

    message: inference_pb2.ModelInferRequest  # everything else (its raw_input_contents are empty)
    raw_input_contents: list[memoryview]


def _varint(data: bytes | memoryview, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7


def split_infer_request(data: bytes | memoryview) -> LargeInferRequest | None:
    """`data` as a `LargeInferRequest`, or None when its top level is not plain enough to walk
    (protobuf's parse then decides what it is). Raises protobuf's `DecodeError` for the rest."""
    view = memoryview(data)
    kept: list[memoryview] = []
    raw: list[memoryview] = []
    kept_from = position = 0
    try:
        for _ in range(_MAX_TOP_FIELDS):
            if position >= len(data):
                break
            key, after_key = _varint(data, position)
            wire_type = key & 7
            if wire_type == 0:
                _, end = _varint(data, after_key)
            elif wire_type == 1:
                end = after_key + 8
            elif wire_type == 5:
                end = after_key + 4
            elif wire_type == _LENGTH_DELIMITED:
                length, start = _varint(data, after_key)
                end = start + length
                if key >> 3 == _RAW_INPUT_CONTENTS and end <= len(data):
                    kept.append(view[kept_from:position])
                    raw.append(view[start:end])
                    kept_from = end
            else:
                return None
            if end > len(data):
                return None
            position = end
        else:
            return None
    except ValueError:
        return None
    kept.append(view[kept_from:])
    message = inference_pb2.ModelInferRequest.FromString(b"".join(kept))
    return LargeInferRequest(message, raw)


def _length_prefix(field_number: int, length: int) -> bytes:
    """The key and length of a length-delimited field."""
    out = bytearray()
    for value in (field_number << 3 | _LENGTH_DELIMITED, length):
        while value > 0x7F:
            out.append(value & 0x7F | 0x80)
            value >>= 7
        out.append(value)
    return bytes(out)


def encode_infer_response(
    message: inference_pb2.ModelInferResponse, raw_output_contents: list[memoryview], *, stream: bool
) -> list[bytes | memoryview]:
    """The wire form of `message` with `raw_output_contents` (its own are empty), as parts whose
    concatenation is the message; wrapped as a `ModelStreamInferResponse` when `stream`. Only
    the small rest is encoded here: the outputs are referred to, not copied."""
    parts: list[bytes | memoryview] = [message.SerializeToString()]
    for data in raw_output_contents:
        parts += [_length_prefix(_RAW_OUTPUT_CONTENTS, data.nbytes), data]
    if stream:
        parts.insert(0, _length_prefix(_INFER_RESPONSE, sum(len(part) for part in parts)))
    return parts
