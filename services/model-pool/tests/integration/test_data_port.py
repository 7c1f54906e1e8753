"""The worker's ZMQ data port, driven by a real DEALER like the gateway's."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np

from loadmaster.model_pool.server import ModelPoolServer
from loadmaster.v1 import errors_pb2, model_pool_pb2, tensor_pb2

OK = errors_pb2.ERROR_CODE_UNSPECIFIED


async def test_data_endpoint_is_the_bound_port(worker: ModelPoolServer) -> None:
    assert worker.data_endpoint.startswith("tcp://127.0.0.1:")
    assert not worker.data_endpoint.endswith(":*")
    assert worker.worker_id == "worker-test"
    assert worker.port and worker.grpc_endpoint == f"127.0.0.1:{worker.port}"


async def test_double(client: Any) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    img = np.array([[1, 2], [127, 200]], dtype=np.uint8)
    reply, outputs = await client.call("double", {"x": x, "img": img}, request_id="abc")
    assert reply.error_code == OK, reply.error_message
    assert (reply.request_id, reply.model_id, reply.worker_id) == ("abc", "double", "worker-test")
    assert reply.generation == 1 and reply.batch_size == 1
    assert reply.inference_latency_ms >= 0 and reply.queue_ms >= 0
    np.testing.assert_array_equal(outputs["x"], x * 2)
    assert outputs["img"].dtype == np.uint8
    np.testing.assert_array_equal(outputs["img"], (img.astype(np.int32) * 2 % 256).astype(np.uint8))


async def test_policy_matches_its_reference(client: Any, example_repo: Path) -> None:
    reference = np.load(example_repo / "policy" / "artifacts" / "reference.npz")
    reply, outputs = await client.call("policy", {"state": reference["input.state"]})
    assert reply.error_code == OK, reply.error_message
    np.testing.assert_allclose(outputs["action"], reference["output.action"], rtol=1e-5, atol=1e-6)


async def test_bad_tensor_then_the_next_request_works(client: Any) -> None:
    request, payload = client.request("double", {"x": np.ones(4, np.float32)})
    request.inputs[0].byte_length = 12  # 4 float32 need 16 bytes
    await client.send(request, payload)
    reply, outputs = await client.receive()
    assert reply.error_code == errors_pb2.ERROR_CODE_INVALID_ARGUMENT
    assert "tensor 'x'" in reply.error_message and not reply.retryable and outputs == {}

    request, payload = client.request("policy", {"state": np.ones((2, 31), np.float32)})
    await client.send(request, payload)
    reply, _ = await client.receive()
    assert reply.error_code == errors_pb2.ERROR_CODE_INVALID_ARGUMENT
    assert "tensor 'state'" in reply.error_message

    reply, outputs = await client.call("double", {"x": np.ones(4, np.float32)})
    assert reply.error_code == OK and outputs["x"].tolist() == [2.0] * 4


async def test_malformed_messages_are_answered(client: Any) -> None:
    await client.send_raw([b"", b"\xff\xff not a protobuf", b""])
    reply, _ = await client.receive()
    assert reply.error_code == errors_pb2.ERROR_CODE_INVALID_ARGUMENT
    assert "not an InferRequest" in reply.error_message
    await client.send_raw([b"", b"a", b"b", b"c", b"d"])  # too many frames
    reply, _ = await client.receive()
    assert reply.error_code == errors_pb2.ERROR_CODE_INVALID_ARGUMENT
    await client.send_raw([b"only-one-frame"])  # no empty delimiter
    reply, _ = await client.receive()
    assert reply.error_code == errors_pb2.ERROR_CODE_INVALID_ARGUMENT
    bad_dtype = model_pool_pb2.InferRequest(
        request_id="d",
        model_id="double",
        inputs=[tensor_pb2.Tensor(key="x", dtype=99, shape=[1], byte_length=1)],
    )
    await client.send_raw([b"", bad_dtype.SerializeToString(), b"\0"])
    reply, _ = await client.receive()
    assert reply.error_code == errors_pb2.ERROR_CODE_INVALID_ARGUMENT and "tensor 'x'" in reply.error_message
    reply, _ = await client.call("double", {"x": np.ones(1, np.float32)})
    assert reply.error_code == OK


async def test_unknown_and_unloaded_models(client: Any) -> None:
    reply, _ = await client.call("no-such-model", {"x": np.ones(1, np.float32)})
    assert reply.error_code == errors_pb2.ERROR_CODE_NOT_FOUND and not reply.retryable
    reply, _ = await client.call("classifier", {"image": np.zeros((480, 640, 3), np.uint8)})  # not preloaded
    assert reply.error_code == errors_pb2.ERROR_CODE_UNAVAILABLE and reply.retryable
    assert "idle" in reply.error_message


async def test_slow_request_does_not_delay_another_model(worker: ModelPoolServer, make_client: Any) -> None:
    slow_client = make_client(worker.data_endpoint)
    fast_client = make_client(worker.data_endpoint)
    await slow_client.send(*slow_client.request("sleep", {"ms": np.array([600], np.float32)}))
    await asyncio.sleep(0.05)  # the sleep request is running
    started = time.monotonic()
    reply, outputs = await fast_client.call("double", {"x": np.ones(2, np.float32)})
    fast_s = time.monotonic() - started
    assert reply.error_code == OK and outputs["x"].tolist() == [2.0, 2.0]
    assert fast_s < 0.45, f"double took {fast_s:.3f}s behind a 600 ms sleep"
    assert not await slow_client.socket.poll(0)  # the sleep reply is still to come
    reply, outputs = await slow_client.receive()
    assert reply.error_code == OK and outputs["ms"].tolist() == [600.0]


async def test_one_dealer_gets_replies_out_of_order(client: Any) -> None:
    await client.send(*client.request("sleep", {"ms": np.array([300], np.float32)}, request_id="slow"))
    await client.send(*client.request("double", {"x": np.ones(1, np.float32)}, request_id="fast"))
    first, _ = await client.receive()
    second, _ = await client.receive()
    assert (first.request_id, second.request_id) == ("fast", "slow")


async def test_expired_deadline_is_never_run(client: Any) -> None:
    past = time.time_ns() - 1_000_000
    reply, outputs = await client.call("sleep", {"ms": np.array([0], np.float32)}, deadline_unix_ns=past)
    assert reply.error_code == errors_pb2.ERROR_CODE_EXPIRED and outputs == {}
    future = time.time_ns() + 5_000_000_000
    reply, _ = await client.call("sleep", {"ms": np.array([0], np.float32)}, deadline_unix_ns=future)
    assert reply.error_code == OK


async def test_engine_errors_are_internal_replies(client: Any) -> None:
    reply, _ = await client.call("sleep", {"ms": np.array([-5], np.float32)})
    assert reply.error_code == errors_pb2.ERROR_CODE_INVALID_ARGUMENT  # the model raised it
    reply, _ = await client.call("sleep", {"ms": np.array([1], np.float64)})
    assert reply.error_code == errors_pb2.ERROR_CODE_INVALID_ARGUMENT and "tensor 'ms'" in reply.error_message


async def test_classifier_matches_its_reference(
    classifier_repo: Path, leases: Any, start_worker: Any, make_client: Any
) -> None:
    reference = np.load(classifier_repo / "classifier" / "artifacts" / "reference.npz")
    async with start_worker(classifier_repo, preload=["classifier"], lease_client=leases) as worker:
        client = make_client(worker.data_endpoint)
        reply, outputs = await client.call("classifier", {"image": reference["input.image"]})
        assert reply.error_code == OK, reply.error_message
        assert outputs["logits"].shape == (10,)
        np.testing.assert_allclose(outputs["logits"], reference["output.logits"], rtol=1e-4, atol=1e-5)


async def test_a_burst_from_many_dealers_is_answered_per_request(
    worker: ModelPoolServer, make_client: Any
) -> None:
    """Requests sent at once (batched together by `policy`) each get their own rows back, on the
    DEALER that sent them."""
    rng = np.random.default_rng(7)
    states = [rng.standard_normal((1, 32)).astype(np.float32) for _ in range(16)]
    alone = make_client(worker.data_endpoint)
    expected = []
    for state in states:  # one at a time: the reference for each input
        reply, outputs = await alone.call("policy", {"state": state})
        assert reply.error_code == OK, reply.error_message
        expected.append(outputs["action"])
    clients = [make_client(worker.data_endpoint) for _ in range(4)]
    for index, state in enumerate(states):
        client = clients[index % 4]
        await client.send(*client.request("policy", {"state": state}, request_id=f"s{index}"))
    answered = {}
    for index, client in enumerate(clients):
        for _ in range(4):
            reply, outputs = await client.receive()
            assert reply.error_code == OK, reply.error_message
            number = int(reply.request_id[1:])
            assert number % 4 == index  # the reply came back to its sender
            answered[number] = outputs["action"]
    assert sorted(answered) == list(range(16))
    for number, action in answered.items():
        np.testing.assert_allclose(action, expected[number], rtol=1e-5, atol=1e-6)


async def test_a_huge_bytes_request_is_decoded_off_the_loop_and_others_go_by(client: Any) -> None:
    """A million BYTES elements of alternating lengths (the costliest layout to check and decode,
    hundreds of ms) to `sleep`, which echoes them: on the loop, every later request waited for
    it; off the loop, a small one sent after it is answered first, and the huge one is answered
    too, every element back."""
    count = 1_000_000
    text = np.array([b"", b"a"] * (count // 2), dtype=object)
    huge = client.request("sleep", {"ms": np.zeros(1, np.float32), "text": text}, request_id="huge")
    await client.send(*huge)
    await asyncio.sleep(0.05)  # the huge one is in the worker first
    await client.send(*client.request("double", {"x": np.ones(2, np.float32)}, request_id="small"))
    first, _ = await client.receive(timeout_s=60)
    second, outputs = await client.receive(timeout_s=60)
    assert [first.request_id, second.request_id] == ["small", "huge"]
    assert first.error_code == OK
    assert second.error_code == OK, second.error_message
    assert len(outputs["text"]) == count and outputs["text"][1] == b"a"
