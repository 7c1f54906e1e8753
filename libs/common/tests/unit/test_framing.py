"""ROUTER multipart framing and the edge failure reply."""

from __future__ import annotations

import time

import pytest
import zmq

from loadmaster.common.errors import ExpiredError, InvalidArgumentError, LoadmasterError, NotFoundError
from loadmaster.common.framing import (
    ERROR_CODE_KEY,
    ERROR_KEY,
    REQUEST_ID_KEY,
    edge_error_response,
    router_reply,
    split_router_frames,
)
from loadmaster.v1 import edge_pb2


def test_four_frames_split_into_identity_envelope_payload() -> None:
    frames = split_router_frames([b"robot-1", b"", b"envelope", b"payload"])
    assert (frames.identity, frames.envelope, frames.payload) == (b"robot-1", b"envelope", b"payload")


def test_three_frames_mean_an_empty_payload() -> None:
    frames = split_router_frames([b"id", b"", b"envelope"])
    assert frames.payload == b""
    assert frames.envelope == b"envelope"


def test_zmq_frames_keep_their_buffers_and_the_identity_becomes_bytes() -> None:
    identity, empty, envelope, payload = (zmq.Frame(b) for b in (b"\x00ab", b"", b"env", b"data"))
    frames = split_router_frames([identity, empty, envelope, payload])
    assert frames.identity == b"\x00ab" and isinstance(frames.identity, bytes)
    assert frames.envelope is envelope and frames.payload is payload  # no copies of the big frames


@pytest.mark.parametrize("count", [0, 1, 2, 5, 6])
def test_wrong_frame_counts_are_invalid_arguments(count: int) -> None:
    frames = [b"id", b"", b"env", b"payload", b"extra", b"more"][:count]
    with pytest.raises(InvalidArgumentError, match=f"got {count}"):
        split_router_frames(frames)


def test_a_non_empty_delimiter_is_an_invalid_argument() -> None:
    with pytest.raises(InvalidArgumentError, match="empty"):
        split_router_frames([b"id", b"x", b"env", b"payload"])
    with pytest.raises(InvalidArgumentError, match="empty"):
        split_router_frames([zmq.Frame(b"id"), zmq.Frame(b"x"), zmq.Frame(b"env")])


def test_router_reply_layout() -> None:
    assert router_reply(b"id", b"env", b"pay") == [b"id", b"", b"env", b"pay"]
    assert router_reply(b"id", b"env") == [b"id", b"", b"env", b""]


def test_edge_error_response_carries_message_code_and_request_id() -> None:
    client = edge_pb2.Client(id="robot-7", type="arm")
    before = time.time_ns()
    reply = edge_error_response(
        ExpiredError("deadline passed"), model_id="policy", client=client, request_id="r-1"
    )
    assert reply.model_id == "policy"
    assert reply.client == client
    assert reply.response_id == "r-1"
    assert dict(reply.metadata) == {
        ERROR_KEY: "deadline passed",
        ERROR_CODE_KEY: "expired",
        REQUEST_ID_KEY: "r-1",
    }
    assert len(reply.tensors) == 0
    assert before <= reply.timestamp_ns <= time.time_ns()
    parsed = edge_pb2.ModelResponse.FromString(reply.SerializeToString())
    assert parsed == reply


def test_edge_error_response_without_request_id_gets_a_fresh_response_id() -> None:
    first = edge_error_response(NotFoundError("no model"), model_id="m")
    second = edge_error_response(NotFoundError("no model"), model_id="m")
    assert first.response_id and second.response_id and first.response_id != second.response_id
    assert REQUEST_ID_KEY not in first.metadata
    assert not first.HasField("client")
    assert first.metadata[ERROR_CODE_KEY] == "not_found"


@pytest.mark.parametrize("cls", LoadmasterError.__subclasses__(), ids=lambda c: c.__name__)
def test_every_error_becomes_its_edge_code(cls: type[LoadmasterError]) -> None:
    reply = edge_error_response(cls("boom"), model_id="m")
    assert reply.metadata[ERROR_CODE_KEY] == cls("boom").edge_code != ""
    assert reply.metadata[ERROR_KEY] == "boom"
