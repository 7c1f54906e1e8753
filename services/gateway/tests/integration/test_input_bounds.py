"""What a request may carry and how long it may take to arrive, on every front end (issue 25).

The gateway behind these tests has no scheduler: a request that passes every check is
answered `unavailable` (HTTP 503, gRPC UNAVAILABLE), so "not refused" reads as that.
"""

from __future__ import annotations

import hashlib
import json
import queue
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx
import numpy as np
import psutil
import pytest
import tritonclient.grpc as triton_grpc
import zmq
from tritonclient.utils import InferenceServerException

from loadmaster.v1 import edge_pb2, scheduler_pb2_grpc, tensor_pb2

LIMITED_KEY = "lm_stream-limited-0123456789abcdefghij"
CONFIG = {
    "limits": {
        "max_json_bytes": 4096,
        "max_payload_bytes": 1 << 20,
        "max_envelope_bytes": 64 << 10,
        "http_header_timeout_s": 1.0,
        "http_body_timeout_s": 1.0,
    },
}
LIMITED = {
    "auth": {
        "api_keys": [
            {
                "name": "limited",
                "sha256": hashlib.sha256(LIMITED_KEY.encode()).hexdigest(),
                "scopes": ["infer"],
                "rate_per_s": 5,
                "burst": 5,
            }
        ]
    }
}


@pytest.fixture(scope="module")
def gateway(start_gateway: Callable[..., Any]) -> Any:
    return start_gateway(CONFIG)


def _infer(gateway: Any, body: Any, path: str = "/v2/models/double/infer", **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{gateway.http_url}{path}", json=body, timeout=10, **kwargs)


# --- HTTP JSON values are taken as they are, never coerced ---------------------------------


@pytest.mark.parametrize(
    ("tensor", "expected"),
    [
        (
            {"datatype": "BOOL", "shape": [2], "data": [True, "false"]},
            'data[1] is "false", not a JSON boolean',
        ),
        ({"datatype": "INT32", "shape": [2], "data": [1, 1.5]}, "data[1] is 1.5, not a JSON integer"),
        ({"datatype": "INT32", "shape": [1], "data": [True]}, "data[0] is true, not a JSON integer"),
        ({"datatype": "FP32", "shape": [2], "data": [1.0, None]}, "data[1] is null, not a JSON number"),
        ({"datatype": "BYTES", "shape": [1], "data": [7]}, "data[0] is 7, not a JSON string"),
        ({"datatype": "FP32", "shape": ["2"], "data": [1.0, 2.0]}, "inputs.0.shape.0"),
        ({"datatype": "FP32", "shape": [2**70], "data": []}, "0 elements in data for shape"),
        ({"datatype": "FP32", "shape": [0, 2**62], "data": []}, "too large"),
    ],
)
def test_http_json_values_of_the_wrong_kind_are_refused_naming_the_field(
    gateway: Any, tensor: dict[str, Any], expected: str
) -> None:
    reply = _infer(gateway, {"inputs": [{"name": "x", **tensor}]})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert expected in error
    if "data[" in expected:
        assert "tensor 'x'" in error


def test_http_json_values_of_the_right_kind_pass(gateway: Any) -> None:
    body = {
        "inputs": [
            {"name": "b", "datatype": "BOOL", "shape": [2], "data": [True, False]},
            {"name": "i", "datatype": "INT32", "shape": [2, 1], "data": [[1], [-2]]},
            {"name": "f", "datatype": "FP32", "shape": [2], "data": [1, 2.5]},
        ]
    }
    assert _infer(gateway, body).status_code == 503  # every check passed: no scheduler behind it


# --- shapes, versions -----------------------------------------------------------------------


def test_a_shape_numpy_cannot_build_is_invalid_argument_on_every_front_end(gateway: Any) -> None:
    client = triton_grpc.InferenceServerClient(gateway.grpc_address)
    try:
        tensor = triton_grpc.InferInput("x", [0, 2**62], "FP32")
        tensor._raw_content = b""  # an empty tensor of that shape: no data to set from numpy
        with pytest.raises(InferenceServerException) as raised:
            client.infer("double", [tensor])
        assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "too large" in raised.value.message()
    finally:
        client.close()
    # no client library builds such an array: the envelope is written by hand
    observation = edge_pb2.Observation(
        model_id="double",
        tensors=[
            tensor_pb2.Tensor(
                key="x", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[0, 2**62], encoding=tensor_pb2.ENCODING_RAW
            )
        ],
    )
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(gateway.edge)
        dealer.send_multipart([b"", observation.SerializeToString(), b""])
        assert dealer.poll(10_000), "no reply"
        frames = dealer.recv_multipart()
        dealer.close()
    finally:
        context.term()
    response = edge_pb2.ModelResponse.FromString(frames[1])
    assert response.metadata["error_code"] == "invalid_argument"
    assert "too large" in response.metadata["error"]


def test_a_version_other_than_1_is_not_found(gateway: Any) -> None:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
    reply = _infer(gateway, body, "/v2/models/double/versions/99999/infer")
    assert reply.status_code == 404 and "no version '99999'" in reply.json()["error"]
    assert httpx.get(f"{gateway.http_url}/v2/models/double/versions/99999", timeout=10).status_code == 404
    assert _infer(gateway, body, "/v2/models/double/versions/1/infer").status_code == 503
    client = triton_grpc.InferenceServerClient(gateway.grpc_address)
    try:
        tensor = triton_grpc.InferInput("x", [1], "FP32")
        tensor.set_data_from_numpy(np.ones(1, np.float32))
        with pytest.raises(InferenceServerException) as raised:
            client.infer("double", [tensor], model_version="99999")
        assert raised.value.status() == "StatusCode.NOT_FOUND"
        assert not client.is_model_ready("double", "99999")
    finally:
        client.close()


# --- body sizes -----------------------------------------------------------------------------


def test_json_bodies_have_their_own_limit_below_binary_data(gateway: Any) -> None:
    big_json = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2000], "data": [0.5] * 2000}]}
    reply = _infer(gateway, big_json)
    assert reply.status_code == 400 and "exceeds the limit of 4096" in reply.json()["error"]
    # the same tensor as binary data after a small JSON header passes (up to max_payload_bytes)
    head = (
        b'{"inputs":[{"name":"x","datatype":"FP32","shape":[2000],"parameters":{"binary_data_size":8000}}]}'
    )
    reply = httpx.post(
        f"{gateway.http_url}/v2/models/double/infer",
        content=head + bytes(8000),
        headers={"Inference-Header-Content-Length": str(len(head))},
        timeout=10,
    )
    assert reply.status_code == 503, reply.text


# --- HTTP read timeouts ---------------------------------------------------------------------


def _read_until_closed(sock: socket.socket, deadline_s: float) -> bytes:
    sock.settimeout(deadline_s)
    received = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return received
        received += chunk


def test_headers_that_never_finish_are_answered_408_and_closed(gateway: Any) -> None:
    host, port = gateway.http_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v2/models/double/infer HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        started = time.monotonic()
        received = _read_until_closed(sock, 8.0)
    assert received.startswith(b"HTTP/1.1 408")
    assert time.monotonic() - started < 6.0


def test_a_body_that_never_finishes_is_answered_408(gateway: Any) -> None:
    host, port = gateway.http_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(
            b"POST /v2/models/double/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"inputs":'
        )
        started = time.monotonic()
        received = _read_until_closed(sock, 8.0)
    assert received.startswith(b"HTTP/1.1 408"), received[:200]
    assert b"not received within 1 s" in received
    # and closed with it: the rest of that body must not be read as the next request
    assert b"connection: close" in received.lower()
    assert time.monotonic() - started < 4.0
    assert httpx.get(f"{gateway.http_url}/v2/health/live", timeout=5).status_code == 200


# --- gRPC: undecodable messages, message size -----------------------------------------------


def test_an_undecodable_grpc_message_is_invalid_argument(gateway: Any) -> None:
    with grpc.insecure_channel(gateway.grpc_address) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as raised:
            infer(b"\xff\xff\xff\xff\x0f", timeout=10)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ModelInfer request is not a valid message" in (raised.value.details() or "")


def test_grpc_refuses_messages_larger_than_the_payload_limit_allows(gateway: Any) -> None:
    with grpc.insecure_channel(gateway.grpc_address) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        # field 7 (raw_input_contents), 1 MiB + 65 KiB: more than payload + envelope limits
        size = (1 << 20) + (65 << 10)
        message = b"\x3a" + _varint(size) + bytes(size)
        with pytest.raises(grpc.RpcError) as raised:
            infer(message, timeout=10)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# --- gRPC streams pay per message -----------------------------------------------------------


def test_each_stream_message_pays_one_rate_limit_token(start_gateway: Callable[..., Any]) -> None:
    limited = start_gateway(LIMITED)
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = triton_grpc.InferenceServerClient(limited.grpc_address)
    try:
        client.start_stream(
            lambda result, error: results.put((result, error)),
            headers={"authorization": f"Bearer {LIMITED_KEY}"},
        )
        tensor = triton_grpc.InferInput("x", [1], "FP32")
        tensor.set_data_from_numpy(np.ones(1, np.float32))
        for index in range(30):
            client.async_stream_infer("double", [tensor], request_id=str(index))
        errors = [results.get(timeout=10)[1] for _ in range(30)]
    finally:
        client.stop_stream()
        client.close()
    limited_out = [e for e in errors if e is not None and "rate limit" in str(e)]
    assert len(limited_out) >= 20, [str(e) for e in errors]  # 5 burst + 5/s refill over the run


class _SilentScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    """A scheduler that takes the gateway's Session and never grants: it only counts Enqueues."""

    def __init__(self) -> None:
        self.enqueued = 0

    def Session(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802 - gRPC method name
        for message in request_iterator:
            self.enqueued += len(message.enqueue)
        return iter(())


def test_a_stream_has_at_most_max_stream_inflight_requests_in_flight(
    start_gateway: Callable[..., Any],
) -> None:
    scheduler = _SilentScheduler()
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(scheduler, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = None
    try:
        gateway = start_gateway({"limits": {"max_stream_inflight": 4}}, scheduler_address=f"127.0.0.1:{port}")
        client = triton_grpc.InferenceServerClient(gateway.grpc_address)
        client.start_stream(lambda result, error: None)
        tensor = triton_grpc.InferInput("x", [1], "FP32")
        tensor.set_data_from_numpy(np.ones(1, np.float32))
        for index in range(40):
            client.async_stream_infer("double", [tensor], request_id=str(index))
        deadline = time.monotonic() + 10
        while scheduler.enqueued < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # room for any further message the stream would wrongly read
        assert scheduler.enqueued == 4
    finally:
        if client is not None:
            client.stop_stream(cancel_requests=True)
            client.close()
        server.stop(0)


def test_large_grpc_requests_are_read_and_checked_like_small_ones(start_gateway: Callable[..., Any]) -> None:
    """Over 1 MiB, a request's data stays in the received message (no copy); checks are the same."""
    gateway = start_gateway({"limits": {"max_payload_bytes": 8 << 20}})
    client = triton_grpc.InferenceServerClient(gateway.grpc_address)
    try:
        first = triton_grpc.InferInput("a", [300_000], "FP32")
        first.set_data_from_numpy(np.ones(300_000, np.float32))
        second = triton_grpc.InferInput("b", [3], "BYTES")
        second.set_data_from_numpy(np.array([b"x" * 400_000, b"", b"yz"], dtype=object))
        with pytest.raises(InferenceServerException) as raised:
            client.infer("double", [first, second])
        assert raised.value.status() == "StatusCode.UNAVAILABLE"  # every check passed
        short = triton_grpc.InferInput("b", [4], "BYTES")
        short.set_data_from_numpy(np.array([b"x" * 400_000, b"", b"yz", b"w"], dtype=object))
        short._input.shape[:] = [5]  # claims one element more than its data holds
        with pytest.raises(InferenceServerException) as raised:
            client.infer("double", [first, short])
        assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "tensor 'b': BYTES data ends inside element 4 of 5" in raised.value.message()
    finally:
        client.close()


# --- refused requests are freed when answered ----------------------------------------------


@pytest.mark.slow
def test_refused_large_grpc_requests_do_not_stay_resident(start_gateway: Callable[..., Any]) -> None:
    """The allocator keeps some freed memory for reuse, so the first requests raise the resident
    size; after them it must stay put (a refused request kept until a garbage collection, ~100
    MiB each here, made it climb by hundreds of MiB)."""
    big = start_gateway({"limits": {"max_tensors": 1}})
    process = psutil.Process(big.process.pid)
    client = triton_grpc.InferenceServerClient(big.grpc_address)
    data = np.zeros(12 << 20, np.float32)  # 48 MiB
    try:
        tensors = []
        for name, values in (("a", data), ("b", data[:1])):  # refused by max_tensors once all arrived
            tensor = triton_grpc.InferInput(name, [values.size], "FP32")
            tensor.set_data_from_numpy(values)
            tensors.append(tensor)
        resident = []
        for index in range(12):
            with pytest.raises(InferenceServerException) as raised:
                client.infer("double", tensors)
            assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
            if index in (3, 11):
                resident.append(process.memory_info().rss)
    finally:
        client.close()
    grown = resident[1] - resident[0]
    assert grown < 96 << 20, f"the gateway grew by {grown >> 20} MiB over 8 refused 48 MiB requests"


def test_failed_large_http_requests_are_freed_with_their_reply(start_gateway: Callable[..., Any]) -> None:
    """Each 40 MiB request passes every check and is answered 503 (no scheduler). Its body must
    go with the reply: kept in a reference cycle through the error's traceback, each one stayed
    resident until a garbage collection (measured +65 MiB per 64 MiB request)."""
    big = start_gateway({})
    process = psutil.Process(big.process.pid)
    size = 40 << 20
    head = json.dumps(
        {
            "inputs": [
                {"name": "x", "datatype": "UINT8", "shape": [size], "parameters": {"binary_data_size": size}}
            ]
        }
    ).encode()
    body = head + bytes(size)
    resident = []
    with httpx.Client(timeout=30) as http:
        for _ in range(4):
            reply = http.post(
                f"{big.http_url}/v2/models/double/infer",
                content=body,
                headers={"Inference-Header-Content-Length": str(len(head))},
            )
            assert reply.status_code == 503, reply.text
            resident.append(process.memory_info().rss)
    grown = resident[-1] - resident[0]
    assert grown < 32 << 20, f"the gateway grew by {grown >> 20} MiB over 3 answered 40 MiB requests"


def _costly_observation(count: int = 1_000_000) -> tuple[edge_pb2.Observation, bytes]:
    """`count` BYTES elements of alternating lengths: the costliest layout to check."""
    lengths = np.tile(np.array([0, 1], dtype="<u4"), count // 2)
    prefixes = lengths.view(np.uint8).reshape(count, 4)
    payload = b"".join(
        prefix.tobytes() + (b"x" if length else b"") for prefix, length in zip(prefixes, lengths, strict=True)
    )
    tensor = tensor_pb2.Tensor(
        key="s",
        dtype=tensor_pb2.DTYPE_BYTES,
        shape=[count],
        byte_length=len(payload),
        encoding=tensor_pb2.ENCODING_RAW,
    )
    return edge_pb2.Observation(model_id="echo", tensors=[tensor]), payload


def test_costly_edge_observations_checked_at_once_are_bounded(start_gateway: Callable[..., Any]) -> None:
    """Each costly observation holds its payload while a thread checks it: past
    `edge.max_offloop_checks` at once the next is refused, not queued in memory."""
    gateway = start_gateway({"limits": {"max_payload_bytes": 8 << 20}, "edge": {"max_offloop_checks": 1}})
    big, payload = _costly_observation()
    context = zmq.Context()
    codes: list[str] = []
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(gateway.edge)
        for _ in range(3):
            dealer.send_multipart([b"", big.SerializeToString(), payload])
        for _ in range(3):
            assert dealer.poll(30_000), "no reply"
            codes.append(edge_pb2.ModelResponse.FromString(dealer.recv_multipart()[1]).metadata["error_code"])
    finally:
        context.destroy(linger=0)
    assert "resource_exhausted" in codes, codes
    assert codes[0] != "resource_exhausted", codes  # the first one was checked


def test_an_edge_observation_that_is_costly_to_check_does_not_hold_up_another_client(
    start_gateway: Callable[..., Any],
) -> None:
    """1M BYTES elements of alternating lengths (the costliest layout to check) from one
    client; a small request from another client right behind it is answered long before it."""
    gateway = start_gateway({"limits": {"max_payload_bytes": 8 << 20}})
    count = 1_000_000
    lengths = np.tile(np.array([0, 1], dtype="<u4"), count // 2)
    prefixes = lengths.view(np.uint8).reshape(count, 4)
    payload = b"".join(
        prefix.tobytes() + (b"x" if length else b"") for prefix, length in zip(prefixes, lengths, strict=True)
    )
    big = edge_pb2.Observation(
        model_id="echo",
        tensors=[
            tensor_pb2.Tensor(
                key="s",
                dtype=tensor_pb2.DTYPE_BYTES,
                shape=[count],
                byte_length=len(payload),
                encoding=tensor_pb2.ENCODING_RAW,
            )
        ],
    )
    small = edge_pb2.Observation(
        model_id="double",
        tensors=[tensor_pb2.Tensor(key="x", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[2], byte_length=3)],
    )
    context = zmq.Context()
    try:
        first, second = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
        for dealer in (first, second):
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(gateway.edge)
        time.sleep(0.2)  # both connected before the race starts
        started = time.monotonic()
        first.send_multipart([b"", big.SerializeToString(), payload])
        time.sleep(0.05)  # the big one has arrived (loopback) and is being checked
        small_sent = time.monotonic()
        second.send_multipart([b"", small.SerializeToString(), b"\x00\x00\x00"])
        answered: dict[str, float] = {}
        poller = zmq.Poller()
        poller.register(first, zmq.POLLIN)
        poller.register(second, zmq.POLLIN)
        deadline = started + 30
        while len(answered) < 2 and time.monotonic() < deadline:
            for dealer, _ in poller.poll(1000):
                dealer.recv_multipart()
                answered["big" if dealer is first else "small"] = time.monotonic() - (
                    started if dealer is first else small_sent
                )
    finally:
        context.destroy(linger=0)
    assert set(answered) == {"big", "small"}, answered
    # Checked on the loop, the small request would wait for the rest of the big one's check.
    assert answered["small"] < (answered["big"] - 0.05) / 2, answered
