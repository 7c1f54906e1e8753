"""The data port's answering side without sockets: replies of one batch share one encoded
template and leave together, after the callbacks that produced them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zmq

from loadmaster.common.errors import NotFoundError
from loadmaster.common.tensors import decode_tensors, encode_tensors
from loadmaster.model_pool import wire
from loadmaster.model_pool.data_port import DataPort
from loadmaster.model_pool.generation_order import OrderPolicy
from loadmaster.model_pool.pool import InferResult
from loadmaster.model_pool.wire import ResultEncoder, result_reply
from loadmaster.v1 import errors_pb2, model_pool_pb2


def _batch(rows: int, *, batch_id: int, generation: int = 3, inference_ms: float = 1.5) -> list[InferResult]:
    """What the pool hands back for `rows` one-row requests run as one engine call."""
    outputs = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) + batch_id
    return [
        InferResult({"y": outputs[i : i + 1]}, generation, inference_ms, 0.25 * i, rows, batch_id)
        for i in range(rows)
    ]


def _parsed(envelope: bytes, payload: Any) -> tuple[model_pool_pb2.InferResponse, dict[str, np.ndarray]]:
    reply = model_pool_pb2.InferResponse.FromString(envelope)
    return reply, decode_tensors(reply.outputs, memoryview(payload))


def test_a_batch_shares_one_template_and_each_reply_keeps_its_own_fields() -> None:
    encoder = ResultEncoder("w1")
    results = _batch(3, batch_id=7)
    encoded = [encoder.encode(r, request_id=f"r{i}", model_id="m") for i, r in enumerate(results)]
    for i, (envelope, payload) in enumerate(encoded):
        reply, outputs = _parsed(envelope, payload)
        expected, _ = result_reply(results[i], request_id=f"r{i}", model_id="m", worker_id="w1")
        for tensor in (*reply.outputs, *expected.outputs):
            tensor.timestamp_ns = 0  # the only field allowed to differ
        assert reply == expected
        np.testing.assert_array_equal(outputs["y"], results[i].outputs["y"])
    assert encoded[1][0] != encoded[2][0]  # not the same bytes twice


def test_each_batch_gets_its_own_latency_size_and_time() -> None:
    encoder = ResultEncoder("w1")
    batches = [
        _batch(2, batch_id=1),
        _batch(2, batch_id=2, inference_ms=9.0),  # the same layout: the template is reused
        _batch(3, batch_id=3),  # another batch size
        _batch(3, batch_id=4, generation=4),  # a reloaded model
    ]
    stamps = []
    for number, batch in enumerate(batches):
        for i, result in enumerate(batch):
            reply, outputs = _parsed(*encoder.encode(result, request_id=f"{number}.{i}", model_id="m"))
            assert (reply.request_id, reply.batch_size) == (f"{number}.{i}", len(batch))
            assert (reply.inference_latency_ms, reply.queue_ms) == (result.inference_ms, result.queue_ms)
            assert reply.generation == result.generation
            np.testing.assert_array_equal(outputs["y"], result.outputs["y"])
            stamps.append(reply.outputs[0].timestamp_ns)
    assert stamps[0] == stamps[1] and stamps[1] < stamps[2] == stamps[3]  # one time per batch


def test_unbatched_results_of_one_layout_reuse_the_template(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that runs one request per call (batch size 1) encodes its first reply in full and
    every next one of the same layout from the template, each with its own fields and time."""
    built: list[str] = []
    real = wire.result_reply

    def counting(result: InferResult, **kwargs: Any) -> Any:
        built.append(kwargs["request_id"])
        return real(result, **kwargs)

    monkeypatch.setattr(wire, "result_reply", counting)
    encoder = ResultEncoder("w1")
    stamps = []
    for number in range(4):
        result = _batch(1, batch_id=10 + number, inference_ms=1.0 + number)[0]
        envelope, payload = encoder.encode(result, request_id=f"u{number}", model_id="m")
        reply, outputs = _parsed(envelope, payload)
        expected, _ = real(result, request_id=f"u{number}", model_id="m", worker_id="w1")
        stamps.append(reply.outputs[0].timestamp_ns)
        for tensor in (*reply.outputs, *expected.outputs):
            tensor.timestamp_ns = 0  # the only field allowed to differ
        assert reply == expected
        np.testing.assert_array_equal(outputs["y"], result.outputs["y"])
    assert built == ["u0"]
    assert stamps == sorted(stamps) and stamps[0] > 0


def test_another_shape_or_a_strided_slice_is_encoded_afresh() -> None:
    encoder = ResultEncoder("w1")
    encoder.encode(_batch(2, batch_id=2)[0], request_id="a", model_id="m")
    wider = InferResult({"y": np.ones((2, 4), np.float32)}, 3, 1.5, 0.0, 2, 2)  # two rows, same batch
    reply, outputs = _parsed(*encoder.encode(wider, request_id="c", model_id="m"))
    assert list(reply.outputs[0].shape) == [2, 4] and outputs["y"].shape == (2, 4)
    strided = InferResult({"y": np.ones((2, 8), np.float32)[:, ::2]}, 3, 1.5, 0.0, 2, 2)
    reply, outputs = _parsed(*encoder.encode(strided, request_id="d", model_id="m"))
    assert outputs["y"].shape == (2, 4) and reply.request_id == "d"
    named = InferResult({"z": np.ones((2, 4), np.float32)}, 3, 1.5, 0.0, 2, 3)  # another output name
    reply, outputs = _parsed(*encoder.encode(named, request_id="e", model_id="m"))
    assert [t.key for t in reply.outputs] == ["z"] and list(outputs) == ["z"]


class _FakeSocket:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def send(self, data: Any, flags: int = 0, copy: bool = True, track: bool = False) -> None:
        self.frames.append(bytes(data))

    def messages(self) -> list[list[bytes]]:
        return [self.frames[i : i + 4] for i in range(0, len(self.frames), 4)]


class _FakePool:
    """Admits every request for "m" and keeps its callback; anything else is not found."""

    order_policy = OrderPolicy()

    def __init__(self) -> None:
        self.done: list[Callable[[InferResult | BaseException], None]] = []

    def submit(self, model_id: str, inputs: Any, *, done: Any, **_: Any) -> None:
        if model_id != "m":
            raise NotFoundError(f"model '{model_id}' is not in the repository")
        self.done.append(done)


def _message(request_id: str, model_id: str = "m") -> list[Any]:
    descriptors, payload = encode_tensors({"x": np.zeros((1, 4), np.float32)})
    request = model_pool_pb2.InferRequest(request_id=request_id, model_id=model_id, inputs=descriptors)
    return [
        f"client-{request_id}".encode(),
        zmq.Frame(b""),
        zmq.Frame(request.SerializeToString()),
        zmq.Frame(bytes(payload)),
    ]


@pytest.fixture
async def port() -> tuple[DataPort, _FakePool, _FakeSocket]:
    pool, sock = _FakePool(), _FakeSocket()
    data_port = DataPort(pool, bind="tcp://127.0.0.1:0", worker_id="w1")  # type: ignore[arg-type]
    # What start() sets up, minus the socket: replies go to the fake, sent through its send().
    data_port._socket = sock  # type: ignore[assignment]
    data_port._loop = asyncio.get_running_loop()
    return data_port, pool, sock


async def test_a_batch_of_replies_leaves_together_after_its_callbacks(
    port: tuple[DataPort, _FakePool, _FakeSocket],
) -> None:
    data_port, pool, sock = port
    for i in range(4):
        data_port._handle(_message(f"r{i}"))
    data_port._handle(_message("lost", model_id="nope"))  # refused at the door
    await asyncio.sleep(0)
    assert [m[0] for m in sock.messages()] == [b"client-lost"]
    reply = model_pool_pb2.InferResponse.FromString(sock.messages()[0][2])
    assert reply.error_code == errors_pb2.ERROR_CODE_NOT_FOUND and reply.request_id == "lost"
    sock.frames.clear()

    for done, result in zip(pool.done, _batch(4, batch_id=1), strict=True):
        done(result)
    assert sock.frames == []  # queued: they go once the batch's callbacks are over
    assert not data_port._settled.is_set()
    await asyncio.sleep(0)
    messages = sock.messages()
    assert [m[0] for m in messages] == [f"client-r{i}".encode() for i in range(4)]
    for i, (_identity, empty, envelope, payload) in enumerate(messages):
        reply, outputs = _parsed(envelope, payload)
        assert empty == b"" and reply.request_id == f"r{i}" and reply.batch_size == 4
        np.testing.assert_array_equal(outputs["y"], np.arange(4 * i, 4 * i + 4, dtype=np.float32)[None] + 1)
    assert data_port._settled.is_set()  # nothing pending once every reply went out
