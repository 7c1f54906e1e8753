"""Large KServe messages through shared memory between the gRPC relay and the gateway
(`grpc_handoff`), and the reply encoding that skips protobuf's copies (`grpc_wire`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from loadmaster.gateway.frontends import grpc_handoff
from loadmaster.gateway.frontends.grpc_wire import encode_infer_response, split_infer_request
from loadmaster.gateway.kserve_protocol import inference_pb2

NAME = "loadmaster-grpc-{pid}-" + "ab" * 16


def _files(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def test_a_handed_off_message_is_taken_as_a_view_and_its_file_goes(tmp_path: Path) -> None:
    parts = [b"head", memoryview(np.arange(1000, dtype=np.uint8)), b"tail"]
    marker = grpc_handoff.hand_off(parts, directory=tmp_path)
    assert marker is not None and grpc_handoff.is_marker(marker)
    assert len(_files(tmp_path)) == 1
    view = grpc_handoff.take(marker, directory=tmp_path)
    assert bytes(view) == b"".join(bytes(part) for part in parts)
    assert view.readonly
    assert _files(tmp_path) == []  # unlinked at once; the view still reads it


def test_a_handed_off_reply_is_read_into_bytes_and_its_file_goes(tmp_path: Path) -> None:
    marker = grpc_handoff.hand_off([b"x" * 5000], directory=tmp_path)
    assert marker is not None
    assert grpc_handoff.read(marker, directory=tmp_path) == b"x" * 5000
    assert _files(tmp_path) == []
    with pytest.raises(ValueError, match="gone"):
        grpc_handoff.read(marker, directory=tmp_path)


def test_no_room_means_no_marker(tmp_path: Path) -> None:
    assert grpc_handoff.hand_off([b"x"], directory=tmp_path / "missing") is None


def test_a_client_message_can_never_be_a_marker() -> None:
    assert grpc_handoff.neutralize(b"\x00" + NAME.format(pid=1).encode()) == b"\x00"
    request = inference_pb2.ModelInferRequest(model_name="m").SerializeToString()
    assert grpc_handoff.neutralize(request) == request
    assert not grpc_handoff.is_marker(request)


@pytest.mark.parametrize(
    "name",
    ["../etc/passwd", "loadmaster-gw-1-" + "ab" * 16, NAME.format(pid=1) + "/x", "", "x" * 200],
)
def test_a_marker_names_only_a_relay_file(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError):
        grpc_handoff.take(b"\x00" + name.encode(), directory=tmp_path)


def test_a_link_a_pipe_or_an_empty_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "secret"
    target.write_bytes(b"not yours")
    link, pipe, empty = (NAME.format(pid=n) for n in (1, 2, 3))
    (tmp_path / link).symlink_to(target)
    os.mkfifo(tmp_path / pipe)
    (tmp_path / empty).touch()
    for name in (link, pipe, empty):
        with pytest.raises(ValueError):
            grpc_handoff.take(b"\x00" + name.encode(), directory=tmp_path)
    assert target.read_bytes() == b"not yours"
    assert {link, pipe, empty} <= set(_files(tmp_path))


def test_discard_removes_what_nobody_took(tmp_path: Path) -> None:
    marker = grpc_handoff.hand_off([b"x"], directory=tmp_path)
    assert marker is not None
    grpc_handoff.discard(marker, directory=tmp_path)
    grpc_handoff.discard(marker, directory=tmp_path)  # twice: no error
    assert _files(tmp_path) == []


def test_sweep_removes_files_of_gone_processes_and_old_ones(tmp_path: Path) -> None:
    gone, old, fresh = NAME.format(pid=999_999_999), NAME.format(pid=os.getpid()), "loadmaster-grpc-%d-%s"
    fresh = fresh % (os.getpid(), "cd" * 16)
    for name in (gone, old, fresh, "unrelated"):
        (tmp_path / name).write_bytes(b"x")
    an_hour_ago = time.time() - 3600
    os.utime(tmp_path / old, (an_hour_ago, an_hour_ago))
    assert sorted(grpc_handoff.sweep(tmp_path, max_age_s=60)) == sorted([gone, old])
    assert _files(tmp_path) == sorted([fresh, "unrelated"])


def _response() -> inference_pb2.ModelInferResponse:
    Output = inference_pb2.ModelInferResponse.InferOutputTensor  # noqa: N806
    return inference_pb2.ModelInferResponse(
        model_name="double",
        model_version="1",
        id="r1",
        outputs=[Output(name="x", datatype="FP32", shape=[3])],
    )


def test_an_encoded_reply_parses_as_protobuf_would_have_built_it() -> None:
    raw = [memoryview(np.arange(300_000, dtype=np.float32)).cast("B"), memoryview(b"second")]
    wire = b"".join(encode_infer_response(_response(), raw, stream=False))
    expected = _response()
    expected.raw_output_contents.extend(bytes(data) for data in raw)
    assert inference_pb2.ModelInferResponse.FromString(wire) == expected
    streamed = b"".join(encode_infer_response(_response(), raw, stream=True))
    assert inference_pb2.ModelStreamInferResponse.FromString(streamed).infer_response == expected


def test_a_taken_request_splits_into_views_of_the_shared_memory(tmp_path: Path) -> None:
    request = inference_pb2.ModelInferRequest(model_name="double")
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = "x", "UINT8"
    tensor.shape.append(2 << 20)
    request.raw_input_contents.append(bytes(range(256)) * (2 << 12))
    marker = grpc_handoff.hand_off([request.SerializeToString()], directory=tmp_path)
    assert marker is not None
    large = split_infer_request(grpc_handoff.take(marker, directory=tmp_path))
    assert large is not None
    assert large.message.model_name == "double" and large.message.inputs[0].shape == [2 << 20]
    assert bytes(large.raw_input_contents[0]) == request.raw_input_contents[0]
