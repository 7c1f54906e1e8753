"""The committed generated code matches protos/, and the edge envelope stays Inferential's wire format."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from google.protobuf import descriptor, json_format, unknown_fields
from google.protobuf.message import Message
from inferential.proto import inferential_pb2

from loadmaster.v1 import edge_pb2, tensor_pb2

GENERATE = Path(__file__).resolve().parents[2] / "generate.py"

EDGE_FIELDS: dict[str, dict[str, int]] = {
    "Client": {"id": 1, "type": 2},
    "Tensor": {
        "key": 1,
        "dtype": 2,
        "shape": 3,
        "byte_offset": 4,
        "byte_length": 5,
        "timestamp_ns": 6,
        "encoding": 7,
    },
    "Observation": {
        "client": 1,
        "timestamp_ns": 2,
        "urgency": 3,
        "tensors": 4,
        "model_id": 5,
        "steps_remaining": 6,
        "metadata": 7,
        "priority": 8,
    },
    "ModelResponse": {
        "client": 1,
        "response_id": 2,
        "timestamp_ns": 3,
        "tensors": 4,
        "inference_latency_ms": 5,
        "model_id": 6,
        "metadata": 7,
    },
}
DTYPES = {
    "DTYPE_UNSPECIFIED": 0,
    "FLOAT16": 1,
    "FLOAT32": 2,
    "FLOAT64": 3,
    "BFLOAT16": 4,
    "UINT8": 5,
    "INT32": 6,
    "INT64": 7,
    "BOOL": 8,
}
ENCODINGS = {"ENCODING_UNSPECIFIED": 0, "RAW": 1, "JPEG": 2, "PNG": 3}

# Field types that share a wire encoding: (ours, Inferential's). Timestamps are int64 here and
# uint64 in Inferential: both varints, identical bytes for every value below 2**63.
_VARINT_64 = {descriptor.FieldDescriptor.TYPE_INT64, descriptor.FieldDescriptor.TYPE_UINT64}


# The edge messages as one namespace per side (ours split over edge.proto and tensor.proto).
LOADMASTER = SimpleNamespace(
    Client=edge_pb2.Client,
    Tensor=tensor_pb2.Tensor,
    Observation=edge_pb2.Observation,
    ModelResponse=edge_pb2.ModelResponse,
)
INFERENTIAL = SimpleNamespace(
    Client=inferential_pb2.Client,
    Tensor=inferential_pb2.Tensor,
    Observation=inferential_pb2.Observation,
    ModelResponse=inferential_pb2.ModelResponse,
)


def load_generate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("loadmaster_proto_generate", GENERATE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ours(name: str) -> descriptor.Descriptor:
    if name == "Tensor":
        return tensor_pb2.DESCRIPTOR.message_types_by_name[name]
    return edge_pb2.DESCRIPTOR.message_types_by_name[name]


def theirs(name: str) -> descriptor.Descriptor:
    return inferential_pb2.DESCRIPTOR.message_types_by_name[name]


def test_committed_generated_code_is_current() -> None:
    assert load_generate().stale_files() == []


def test_stale_files_notices_edited_missing_and_extra_files(tmp_path: Path) -> None:
    generate = load_generate()
    committed = generate.OUT_ROOT
    copy = tmp_path / "src"
    shutil.copytree(committed, copy, ignore=shutil.ignore_patterns("__pycache__"))
    generate.OUT_ROOT = copy
    (copy / "loadmaster/v1/edge_pb2.py").write_text("# edited by hand\n")
    (copy / "loadmaster/v1/tensor_pb2.pyi").unlink()
    (copy / "loadmaster/v1/old_pb2.py").write_text("")
    assert generate.stale_files() == [
        "loadmaster/v1/edge_pb2.py",
        "loadmaster/v1/old_pb2.py",
        "loadmaster/v1/tensor_pb2.pyi",
    ]


@pytest.mark.parametrize("message", sorted(EDGE_FIELDS))
def test_edge_field_numbers_are_inferentials(message: str) -> None:
    fields = {f.name: f.number for f in ours(message).fields}
    assert fields == EDGE_FIELDS[message]
    assert {f.name: f.number for f in theirs(message).fields} == EDGE_FIELDS[message]


@pytest.mark.parametrize("message", sorted(EDGE_FIELDS))
def test_edge_field_types_share_inferentials_wire_encoding(message: str) -> None:
    their_fields = {f.number: f for f in theirs(message).fields}
    for field in ours(message).fields:
        other = their_fields[field.number]
        types = {field.type, other.type}
        assert field.type == other.type or types == _VARINT_64, f"{message}.{field.name}"
        assert field.is_repeated == other.is_repeated, f"{message}.{field.name}"
        assert field.has_presence == other.has_presence, f"{message}.{field.name}"
        if field.message_type is not None:
            assert field.message_type.name == other.message_type.name


def _prefixed(prefix: str, name: str) -> str:
    return name if name.startswith(prefix) else prefix + name


def test_enum_numbers_are_inferentials() -> None:
    # Ours is Inferential's plus BYTES = 9 (KServe strings), which its clients never send. The
    # names carry buf's enum prefixes (DTYPE_FLOAT32 for FLOAT32): names never travel, numbers do.
    assert dict(tensor_pb2.Dtype.items()) == {
        _prefixed("DTYPE_", k): v for k, v in {**DTYPES, "BYTES": 9}.items()
    }
    assert dict(tensor_pb2.Encoding.items()) == {_prefixed("ENCODING_", k): v for k, v in ENCODINGS.items()}
    assert dict(inferential_pb2.DType.items()) == DTYPES
    assert dict(inferential_pb2.Encoding.items()) == ENCODINGS


def tensor_fields(key: str, offset: int) -> dict[str, Any]:
    return {
        "key": key,
        "dtype": 8,  # BOOL: the highest enum value
        "shape": [2, 3, -1],
        "byte_offset": offset,
        "byte_length": 6,
        "timestamp_ns": 1_700_000_000_123_456_789,
        "encoding": 1,
    }


def observation(module: SimpleNamespace) -> Message:
    return module.Observation(
        client=module.Client(id="robot-1", type="arm"),
        timestamp_ns=1_700_000_000_987_654_321,
        urgency=0.75,
        tensors=[module.Tensor(**tensor_fields("joints", 0)), module.Tensor(**tensor_fields("image", 6))],
        model_id="policy-v2",
        steps_remaining=0,  # explicit zero: presence must survive
        metadata={"episode": "42", "ünïcode": "✓"},
        priority=3,
    )


def response(module: SimpleNamespace) -> Message:
    return module.ModelResponse(
        client=module.Client(id="robot-1", type="arm"),
        response_id="r-1",
        timestamp_ns=1_700_000_000_111_222_333,
        tensors=[module.Tensor(**tensor_fields("action", 0))],
        inference_latency_ms=1.25,
        model_id="policy-v2",
        metadata={"error": "", "error_code": ""},
    )


def as_dict(message: Message) -> dict[str, Any]:
    # Enums as numbers: those travel; the names differ (DTYPE_FLOAT32 here, FLOAT32 there).
    return json_format.MessageToDict(message, preserving_proto_field_name=True, use_integers_for_enums=True)


@pytest.mark.parametrize("build", [observation, response], ids=["Observation", "ModelResponse"])
@pytest.mark.parametrize("direction", ["inferential->loadmaster", "loadmaster->inferential"])
def test_edge_messages_are_byte_compatible(build: Any, direction: str) -> None:
    source, target = (
        (INFERENTIAL, LOADMASTER) if direction.startswith("inferential") else (LOADMASTER, INFERENTIAL)
    )
    sent = build(source)
    wire = sent.SerializeToString(deterministic=True)
    received = type(build(target)).FromString(wire)
    assert as_dict(received) == as_dict(sent)
    assert received.SerializeToString(deterministic=True) == wire  # nothing unknown, nothing lost
    if hasattr(sent, "steps_remaining"):
        assert received.HasField("steps_remaining") and received.steps_remaining == 0
    assert len(unknown_fields.UnknownFieldSet(received)) == 0
    for tensor in received.tensors:
        assert len(unknown_fields.UnknownFieldSet(tensor)) == 0


def test_an_observation_without_steps_remaining_has_no_presence_either_way() -> None:
    for source, target in ((INFERENTIAL, LOADMASTER), (LOADMASTER, INFERENTIAL)):
        received = target.Observation.FromString(source.Observation(model_id="m").SerializeToString())
        assert not received.HasField("steps_remaining")
