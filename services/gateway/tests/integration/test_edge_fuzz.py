"""Fuzzing the edge: generated envelopes and payloads never crash the gateway; each gets one reply.

The gateway has no scheduler behind it, so a well-formed observation is answered
`unavailable` at once; malformed ones are answered `invalid_argument`. Either way, one
reply per message, and the process stays up. The 10,000-example run is marked slow;
a small variant runs with the fast tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadmaster.v1 import edge_pb2, tensor_pb2

_TEXT = st.text(max_size=12)
_INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_UINT64 = st.integers(min_value=0, max_value=2**64 - 1)

tensors = st.builds(
    tensor_pb2.Tensor,
    key=st.one_of(st.sampled_from(["x", "ms", ""]), _TEXT),
    dtype=st.integers(min_value=0, max_value=12),
    shape=st.lists(st.one_of(st.integers(-2, 8), _INT64), max_size=10),
    byte_offset=st.one_of(st.integers(0, 64), _UINT64),
    byte_length=st.one_of(st.integers(0, 64), _UINT64),
    timestamp_ns=_INT64,
    encoding=st.integers(min_value=0, max_value=5),
)
observations = st.builds(
    edge_pb2.Observation,
    client=st.builds(edge_pb2.Client, id=_TEXT, type=_TEXT),
    timestamp_ns=_INT64,
    urgency=st.floats(width=32, allow_nan=True, allow_infinity=True),
    tensors=st.lists(tensors, max_size=4),
    model_id=st.one_of(st.sampled_from(["double", "sleep", ""]), _TEXT),
    metadata=st.dictionaries(st.sampled_from(["timeout_ms", "request_id", "k"]) | _TEXT, _TEXT, max_size=3),
    priority=st.integers(min_value=0, max_value=2**32 - 1),
)
envelopes = st.one_of(
    observations.map(lambda o: o.SerializeToString()),
    st.binary(max_size=64),
    observations.map(lambda o: o.SerializeToString()[: max(0, len(o.SerializeToString()) - 3)]),
)
messages = st.one_of(
    st.tuples(st.just(b""), envelopes, st.binary(max_size=128)).map(list),  # the protocol's shape
    st.tuples(st.just(b""), envelopes).map(list),  # no payload frame
    st.lists(st.binary(max_size=32), min_size=1, max_size=6),  # any framing at all
)


@pytest.fixture(scope="module")
def edge_socket(start_gateway: Callable[..., Any]) -> Iterator[tuple[Any, zmq.Socket]]:  # type: ignore[type-arg]
    gateway = start_gateway()
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(gateway.edge)
    yield gateway, socket
    socket.close(linger=0)
    context.term()


def _exchange(socket: zmq.Socket, frames: list[bytes]) -> None:  # type: ignore[type-arg]
    socket.send_multipart(frames)
    assert socket.poll(5000, zmq.POLLIN), f"no reply to {frames!r}"
    reply = socket.recv_multipart()
    assert reply[0] == b"" and len(reply) in (3, 4), reply
    response = edge_pb2.ModelResponse.FromString(reply[1])
    assert response.metadata.get("error_code") in ("invalid_argument", "unavailable", "not_found"), response
    assert response.metadata.get("error")


def _fuzz(edge_socket: tuple[Any, zmq.Socket], examples: int) -> None:  # type: ignore[type-arg]
    gateway, socket = edge_socket
    sent = 0

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=examples < 1000,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(messages)
    def one(frames: list[bytes]) -> None:
        nonlocal sent
        sent += 1
        _exchange(socket, frames)

    one()
    assert sent >= math.floor(examples * 0.9)  # hypothesis may stop a little early when it runs out of ideas
    assert not socket.poll(200, zmq.POLLIN), "a message got more than one reply"
    assert gateway.process.poll() is None, "the gateway died"
    log = gateway.log_text()
    assert "Traceback" not in log and "handling failed" not in log, log[-2000:]


def test_fuzz_edge_small(edge_socket: tuple[Any, zmq.Socket]) -> None:  # type: ignore[type-arg]
    _fuzz(edge_socket, 300)


@pytest.mark.slow
def test_fuzz_edge_10k(edge_socket: tuple[Any, zmq.Socket]) -> None:  # type: ignore[type-arg]
    _fuzz(edge_socket, 10_000)
