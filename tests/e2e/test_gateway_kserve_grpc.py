"""The stock `tritonclient[grpc]` against the running suite: KServe v2 over gRPC on the gateway."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from loadmaster.cli.launcher import Suite
from loadmaster.v1 import scheduler_pb2, scheduler_pb2_grpc


@pytest.fixture()
def client(suite: Suite) -> Iterator[triton.InferenceServerClient]:
    connection = triton.InferenceServerClient(suite.settings.gateway.address)
    yield connection
    connection.close()


@pytest.fixture()
def queue_depth(suite: Suite) -> Callable[[str], int]:
    def depth(model_id: str) -> int:
        with grpc.insecure_channel(suite.settings.scheduler.address) as channel:
            reply = scheduler_pb2_grpc.SchedulerServiceStub(channel).GetQueues(
                scheduler_pb2.GetQueuesRequest(), timeout=5
            )
        return next((q.depth for q in reply.queues if q.model_id == model_id), 0)

    return depth


def _input(name: str, array: np.ndarray, datatype: str) -> triton.InferInput:
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def test_health_and_server_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("double")
    assert not client.is_model_ready("no-such-model")
    metadata = client.get_server_metadata(as_json=True)
    assert metadata["name"] == "loadmaster"
    assert "model_repository" in metadata["extensions"]


def test_model_metadata_and_config(client: triton.InferenceServerClient) -> None:
    metadata = client.get_model_metadata("double", as_json=True)
    assert metadata["name"] == "double" and metadata["platform"] == "python"
    config = client.get_model_config("double", as_json=True)["config"]
    assert config["name"] == "double" and config["backend"] == "python"
    with pytest.raises(InferenceServerException) as raised:
        client.get_model_metadata("no-such-model")
    assert raised.value.status() == "StatusCode.NOT_FOUND"
    assert "no-such-model" in raised.value.message()


def test_every_model_reports_its_inputs_and_outputs(client: triton.InferenceServerClient) -> None:
    # A generic KServe client or perf tool discovers every model's tensors: language models
    # describe text_input / text_output (kserve_generative.py), images their tensors.
    index = client.get_model_repository_index(as_json=True)["models"]
    names = [m["name"] for m in index]
    assert {"double", "echo", "tiny-chat", "tiny-diffusion"} <= set(names)
    for name in names:
        metadata = client.get_model_metadata(name, as_json=True)
        assert metadata.get("inputs") and metadata.get("outputs"), name
    chat = client.get_model_metadata("tiny-chat", as_json=True)
    assert chat["inputs"][0] == {"name": "text_input", "datatype": "BYTES", "shape": ["1"]}
    assert chat["outputs"] == [{"name": "text_output", "datatype": "BYTES", "shape": ["1"]}]


def test_model_infer_on_a_language_model_generates_text(client: triton.InferenceServerClient) -> None:
    prompt = triton.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"once upon a time"], dtype=object))
    max_tokens = triton.InferInput("max_tokens", [1], "INT32")
    max_tokens.set_data_from_numpy(np.array([5], dtype=np.int32))
    result = client.infer("tiny-chat", [prompt, max_tokens], client_timeout=120)
    (text,) = result.as_numpy("text_output").tolist()
    assert isinstance(text, bytes) and text.decode()  # five tokens of tiny-chat's random words
    again = client.infer("tiny-chat", [prompt, max_tokens], client_timeout=120)
    assert again.as_numpy("text_output").tolist() == [text]  # greedy by default: the same words


def test_model_metadata_lists_the_declared_inputs_and_outputs(client: triton.InferenceServerClient) -> None:
    metadata = client.get_model_metadata("policy", as_json=True)
    assert metadata["platform"] == "torch"
    assert metadata["inputs"] == [{"name": "state", "datatype": "FP32", "shape": ["-1", "32"]}]
    assert metadata["outputs"] == [{"name": "action", "datatype": "FP32", "shape": ["-1", "8"]}]


@pytest.mark.parametrize(
    ("datatype", "array"),
    [
        ("FP32", np.arange(6, dtype=np.float32).reshape(2, 3)),
        ("FP16", np.array([0.5, 1.5, -2.0], dtype=np.float16)),
        ("UINT8", np.array([0, 1, 100, 200], dtype=np.uint8)),
        ("INT64", np.array([[-(2**40), 7]], dtype=np.int64)),
        ("BOOL", np.array([True, False, True])),
    ],
)
def test_infer_each_datatype(client: triton.InferenceServerClient, datatype: str, array: np.ndarray) -> None:
    result = client.infer("double", [_input("x", array, datatype)], request_id="req-7")
    out = result.as_numpy("x")
    expected = array.copy() if array.dtype == np.bool_ else np.multiply(array, 2, dtype=array.dtype)
    assert out.dtype == array.dtype
    np.testing.assert_array_equal(out, expected)
    assert result.get_response().id == "req-7"


def test_typed_contents_instead_of_raw(suite: Suite) -> None:
    """InferTensorContents (fp32_contents) instead of raw_input_contents, with the stock stubs."""
    with grpc.insecure_channel(suite.settings.gateway.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="double")
        tensor = request.inputs.add(name="x", datatype="FP32", shape=[3])
        tensor.contents.fp32_contents.extend([1.0, 2.5, -4.0])
        reply = stub.ModelInfer(request, timeout=10)
    out = np.frombuffer(reply.raw_output_contents[0], dtype=np.float32)
    np.testing.assert_array_equal(out, [2.0, 5.0, -8.0])
    assert reply.outputs[0].datatype == "FP32"


def test_requested_outputs_and_two_inputs(client: triton.InferenceServerClient) -> None:
    a = np.ones(2, dtype=np.float32)
    b = np.arange(3, dtype=np.int64)
    result = client.infer(
        "double",
        [_input("a", a, "FP32"), _input("b", b, "INT64")],
        outputs=[triton.InferRequestedOutput("b")],
    )
    np.testing.assert_array_equal(result.as_numpy("b"), b * 2)
    assert result.as_numpy("a") is None


def test_errors_map_to_status_codes(client: triton.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as raised:
        client.infer("no-such-model", [_input("x", np.zeros(2, np.float32), "FP32")])
    assert raised.value.status() == "StatusCode.NOT_FOUND"
    bad = triton.InferInput("x", [5], "FP32")
    bad.set_data_from_numpy(np.zeros(5, np.float32))
    bad._get_tensor().shape[:] = [7]  # the data no longer matches the declared shape
    with pytest.raises(InferenceServerException) as raised:
        client.infer("double", [bad])
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "'x'" in raised.value.message()


def test_timeout_parameter_and_deadline_expire(client: triton.InferenceServerClient) -> None:
    ms = _input("ms", np.array([800], dtype=np.float32), "FP32")
    with pytest.raises(InferenceServerException) as raised:
        client.infer("sleep", [ms], client_timeout=0.3)
    assert raised.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    started = time.monotonic()
    blockers = [
        client.async_infer(
            "sleep", [_input("ms", np.array([700], np.float32), "FP32")], callback=lambda *_, **__: None
        )
        for _ in range(4)
    ]
    with pytest.raises(InferenceServerException) as raised:
        client.infer("sleep", [_input("ms", np.array([1], np.float32), "FP32")], timeout=100_000)  # 100 ms
    assert raised.value.status() == "StatusCode.DEADLINE_EXCEEDED", raised.value.message()
    assert time.monotonic() - started < 5
    del blockers


def test_async_infer(client: triton.InferenceServerClient) -> None:
    results: queue.Queue[tuple[int, object, object]] = queue.Queue()

    def done(index: int, result: object, error: object) -> None:
        results.put((index, result, error))

    for index in range(8):
        client.async_infer(
            "double", [_input("x", np.full(3, index, np.float32), "FP32")], callback=partial(done, index)
        )
    seen = {}
    for _ in range(8):
        index, result, error = results.get(timeout=10)
        assert error is None, error
        seen[index] = result.as_numpy("x")  # type: ignore[union-attr]
    for index, out in seen.items():
        np.testing.assert_array_equal(out, np.full(3, 2 * index, np.float32))


def test_streaming(client: triton.InferenceServerClient) -> None:
    replies: queue.Queue[tuple[object, object]] = queue.Queue()
    client.start_stream(callback=lambda result, error: replies.put((result, error)))
    try:
        for index in range(5):
            client.async_stream_infer(
                "double", [_input("x", np.full(2, index, np.float32), "FP32")], request_id=f"s{index}"
            )
        client.async_stream_infer("no-such-model", [_input("x", np.zeros(1, np.float32), "FP32")])
        outputs, errors = {}, []
        for _ in range(6):
            result, error = replies.get(timeout=10)
            if error is not None:
                errors.append(error)
            else:
                outputs[result.get_response().id] = result.as_numpy("x")  # type: ignore[union-attr]
    finally:
        client.stop_stream()
    assert sorted(outputs) == [f"s{i}" for i in range(5)]
    np.testing.assert_array_equal(outputs["s3"], [6.0, 6.0])
    assert len(errors) == 1 and "no-such-model" in str(errors[0])


def test_statistics(client: triton.InferenceServerClient) -> None:
    for _ in range(3):
        client.infer("double", [_input("x", np.ones(2, np.float32), "FP32")])
    deadline = time.monotonic() + 10
    while True:  # the services report to metrics every few hundred ms
        stats = client.get_inference_statistics("double", as_json=True)["model_stats"][0]
        success = int(stats.get("inference_stats", {}).get("success", {}).get("count", 0))
        if success >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert stats["name"] == "double"
    assert success >= 3
    assert int(stats["execution_count"]) >= 1
    with pytest.raises(InferenceServerException) as raised:
        client.get_inference_statistics("no-such-model")
    assert raised.value.status() == "StatusCode.NOT_FOUND"


def test_repository_index_unload_and_load(client: triton.InferenceServerClient) -> None:
    index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    assert index["double"]["state"] == "READY"
    assert {"double", "sleep", "policy"} <= set(index)
    client.unload_model("policy")
    deadline = time.monotonic() + 30
    while client.is_model_ready("policy") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not client.is_model_ready("policy")
    client.load_model("policy")
    deadline = time.monotonic() + 60
    while not client.is_model_ready("policy") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.is_model_ready("policy")
    state = np.zeros((1, 32), dtype=np.float32)
    assert client.infer("policy", [_input("state", state, "FP32")]).as_numpy("action").shape == (1, 8)
    with pytest.raises(InferenceServerException) as raised:
        client.load_model("no-such-model")
    assert raised.value.status() == "StatusCode.NOT_FOUND"


def test_cancelled_call_removes_its_queued_request(
    client: triton.InferenceServerClient, queue_depth: Callable[[str], int]
) -> None:
    """`sleep` has 4 slots: 8 calls of 1.5 s fill them and the place behind each where the
    gateway may stage one (a steady model's); the 9th waits in the queue until cancelled."""
    done = threading.Event()
    finished: list[bool] = []

    def ended(*_: object, **__: object) -> None:
        finished.append(True)
        done.set()

    blockers = [
        client.async_infer("sleep", [_input("ms", np.array([1500], np.float32), "FP32")], callback=ended)
        for _ in range(8)
    ]
    time.sleep(0.5)  # every blocker runs, is staged, or waits (and is counted) by now
    before = queue_depth("sleep")
    queued = client.async_infer(
        "sleep", [_input("ms", np.array([1], np.float32), "FP32")], callback=lambda *_, **__: None
    )
    deadline = time.monotonic() + 5
    while queue_depth("sleep") < before + 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert queue_depth("sleep") == before + 1, "the 9th request should wait behind eight 1.5 s sleeps"
    queued.cancel()
    deadline = time.monotonic() + 2
    while queue_depth("sleep") > before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert queue_depth("sleep") == before
    assert not done.is_set(), "the queue emptied because of the cancel, not because the sleeps ended"
    # `sleep` runs one call at a time at its worker: let the 12 s of blockers end before the next
    # test, whose calls would otherwise wait behind them past their TTL.
    deadline = time.monotonic() + 20
    while len(finished) < len(blockers) and time.monotonic() < deadline:
        time.sleep(0.1)


def test_priority_and_timeout_parameters_are_accepted(client: triton.InferenceServerClient) -> None:
    x = np.ones(2, dtype=np.float32)
    for priority in (0, 1, 3):  # v2/Triton: 0 = default, 1 = highest
        out = client.infer("double", [_input("x", x, "FP32")], priority=priority, timeout=2_000_000)
        np.testing.assert_array_equal(out.as_numpy("x"), x * 2)
    with pytest.raises(InferenceServerException) as raised:
        client.infer("double", [_input("x", x, "FP32")], priority=2**40)
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT" and "priority" in raised.value.message()


def test_bytes_tensors_round_trip_through_echo(client: triton.InferenceServerClient) -> None:
    strings = np.array([[b"hello", b""], ["caf\u00e9".encode(), b"\x00\xff binary"]], dtype=np.object_)
    result = client.infer("echo", [_input("text", strings, "BYTES")])
    out = result.as_numpy("text")
    assert out.shape == (2, 2)
    assert out.tolist() == strings.tolist()
    assert result.get_output("text").datatype == "BYTES"


def test_bytes_as_typed_contents(suite: Suite) -> None:
    with grpc.insecure_channel(suite.settings.gateway.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="echo")
        tensor = request.inputs.add(name="s", datatype="BYTES", shape=[2])
        tensor.contents.bytes_contents.extend([b"ab", b"xyz"])
        reply = stub.ModelInfer(request, timeout=10)
    raw = reply.raw_output_contents[0]
    assert raw == b"\x02\x00\x00\x00ab\x03\x00\x00\x00xyz"  # the v2 BYTES layout
