"""The KServe file in protos/kserve stays a wire-compatible subset of what tritonclient ships,
and Loadmaster's generated code shares a process with the stock KServe client.

The gateway serves tritonclient's own descriptors (loadmaster.gateway.kserve_protocol), so
protos/kserve/ is for other languages only; this test keeps the two from drifting apart.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]
KSERVE = ROOT / "protos" / "kserve"

FieldKey = tuple[str, int]


def compiled_kserve(tmp_path: Path) -> descriptor_pb2.FileDescriptorSet:
    out = tmp_path / "kserve.pb"
    assert (
        protoc.main(["protoc", f"-I{KSERVE}", f"--descriptor_set_out={out}", "inference/grpc_service.proto"])
        == 0
    )
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def shipped() -> list[descriptor_pb2.FileDescriptorProto]:
    from tritonclient.grpc import model_config_pb2, service_pb2

    files = []
    for module in (service_pb2, model_config_pb2):
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        files.append(proto)
    return files


def messages(
    prefix: str, types: list[descriptor_pb2.DescriptorProto]
) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto]]:
    for message in types:
        name = f"{prefix}.{message.name}"
        yield name, message
        yield from messages(name, list(message.nested_type))


def enums(files: list[descriptor_pb2.FileDescriptorProto]) -> dict[str, dict[str, int]]:
    found = {}
    for file in files:
        for enum in file.enum_type:
            found[f".{file.package}.{enum.name}"] = {v.name: v.number for v in enum.value}
        for name, message in messages(f".{file.package}", list(file.message_type)):
            for enum in message.enum_type:
                found[f"{name}.{enum.name}"] = {v.name: v.number for v in enum.value}
    return found


def index(files: list[descriptor_pb2.FileDescriptorProto]) -> dict[str, descriptor_pb2.DescriptorProto]:
    return {
        name: message
        for file in files
        for name, message in messages(f".{file.package}", list(file.message_type))
    }


def wire_differences(
    ours: list[descriptor_pb2.FileDescriptorProto], theirs: list[descriptor_pb2.FileDescriptorProto]
) -> list[str]:
    """Everything in `ours` that the stock descriptors do not carry identically on the wire."""
    problems = []
    their_messages = index(theirs)
    for name, message in index(ours).items():
        other = their_messages.get(name)
        if other is None:
            problems.append(f"{name}: not in the stock protocol")
            continue
        their_fields = {f.number: f for f in other.field}
        for field in message.field:
            peer = their_fields.get(field.number)
            if peer is None:
                problems.append(f"{name}.{field.name} = {field.number}: no such field number upstream")
                continue
            ours_shape = (field.name, field.type, field.label, field.type_name)
            their_shape = (peer.name, peer.type, peer.label, peer.type_name)
            if ours_shape != their_shape:
                problems.append(f"{name}.{field.name}: {ours_shape} != upstream {their_shape}")
    their_enums = enums(theirs)
    for name, values in enums(ours).items():
        for value, number in values.items():
            if their_enums.get(name, {}).get(value) != number:
                problems.append(f"{name}.{value} = {number}: not so upstream")
    their_methods = {
        (service.name, method.name): method
        for file in theirs
        for service in file.service
        for method in service.method
    }
    for file in ours:
        for service in file.service:
            for method in service.method:
                peer = their_methods.get((service.name, method.name))
                shape = (
                    method.input_type,
                    method.output_type,
                    method.client_streaming,
                    method.server_streaming,
                )
                if peer is None or shape != (
                    peer.input_type,
                    peer.output_type,
                    peer.client_streaming,
                    peer.server_streaming,
                ):
                    problems.append(f"{service.name}/{method.name}: not served the same way upstream")
    return problems


def test_the_kserve_file_is_a_wire_compatible_subset_of_the_stock_descriptors(tmp_path: Path) -> None:
    ours = list(compiled_kserve(tmp_path).file)
    assert ours and ours[0].package == "inference"
    assert index(ours), "the file defines messages"
    assert wire_differences(ours, shipped()) == []


def test_the_check_catches_a_field_renumbered(tmp_path: Path) -> None:
    ours = list(compiled_kserve(tmp_path).file)
    request = index(ours)[".inference.ModelInferRequest"]
    next(f for f in request.field if f.name == "raw_input_contents").number = 99
    assert wire_differences(ours, shipped()) == [
        ".inference.ModelInferRequest.raw_input_contents = 99: no such field number upstream"
    ]


def test_the_gateway_serves_the_stock_descriptors() -> None:
    from tritonclient.grpc import service_pb2

    from loadmaster.gateway import kserve_protocol

    assert kserve_protocol.inference_pb2 is service_pb2
    assert kserve_protocol.SERVICE_NAME == "inference.GRPCInferenceService"


@pytest.mark.parametrize("first", ["tritonclient", "loadmaster"])
def test_loadmaster_and_tritonclient_share_a_process(first: str) -> None:
    # A fresh interpreter per order: protobuf's default pool is per process.
    imports = {
        "tritonclient": "import tritonclient.grpc, tritonclient.grpc.aio, tritonclient.http",
        "loadmaster": (
            "import loadmaster.v1.edge_pb2, loadmaster.v1.errors_pb2, loadmaster.v1.gpu_broker_pb2, "
            "loadmaster.v1.metrics_pb2, loadmaster.v1.model_pool_pb2, loadmaster.v1.scheduler_pb2, "
            "loadmaster.v1.tensor_pb2, loadmaster.gateway.frontends.grpc, loadmaster.gateway.server"
        ),
    }
    second = "loadmaster" if first == "tritonclient" else "tritonclient"
    code = f"{imports[first]}\n{imports[second]}\nprint('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
