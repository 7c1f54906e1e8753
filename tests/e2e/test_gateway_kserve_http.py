"""The stock `tritonclient[http]` (and plain HTTP) against the running suite: KServe v2 over HTTP."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from loadmaster.cli.launcher import Suite
from loadmaster.v1 import scheduler_pb2, scheduler_pb2_grpc


@pytest.fixture()
def http_address(suite: Suite) -> str:
    return f"{suite.settings.gateway.http_host}:{suite.settings.gateway.http_port}"


@pytest.fixture()
def client(http_address: str) -> Iterator[triton.InferenceServerClient]:
    connection = triton.InferenceServerClient(http_address, concurrency=8)
    yield connection
    connection.close()


@pytest.fixture()
def queue_info(suite: Suite) -> Callable[[str], scheduler_pb2.QueueInfo]:
    def info(model_id: str) -> scheduler_pb2.QueueInfo:
        with grpc.insecure_channel(suite.settings.scheduler.address) as channel:
            reply = scheduler_pb2_grpc.SchedulerServiceStub(channel).GetQueues(
                scheduler_pb2.GetQueuesRequest(), timeout=5
            )
        return next((q for q in reply.queues if q.model_id == model_id), scheduler_pb2.QueueInfo())

    return info


def _input(name: str, array: np.ndarray, datatype: str, *, binary: bool = True) -> triton.InferInput:
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def test_health_endpoints(client: triton.InferenceServerClient, http_address: str) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("double")
    assert not client.is_model_ready("no-such-model")
    with httpx.Client(base_url=f"http://{http_address}", timeout=5) as http:
        assert http.get("/livez").status_code == 200
        ready = http.get("/readyz")
        assert ready.status_code == 200 and "double" in ready.json()["ready_models"]
        health = http.get("/healthz").json()
        assert health["live"] and health["scheduler_connected"]
        assert http.get("/v2/models/no-such-model/ready").status_code == 404


def test_metadata_and_config(client: triton.InferenceServerClient) -> None:
    assert client.get_server_metadata()["name"] == "loadmaster"
    assert client.get_model_metadata("double")["platform"] == "python"
    assert client.get_model_config("double")["backend"] == "python"
    with pytest.raises(InferenceServerException) as raised:
        client.get_model_metadata("no-such-model")
    assert raised.value.status() == "404"


def test_model_metadata_lists_the_declared_inputs_and_outputs(client: triton.InferenceServerClient) -> None:
    metadata = client.get_model_metadata("policy")
    assert metadata["platform"] == "torch"
    assert metadata["inputs"] == [{"name": "state", "datatype": "FP32", "shape": [-1, 32]}]
    assert metadata["outputs"] == [{"name": "action", "datatype": "FP32", "shape": [-1, 8]}]
    # `double` takes any tensors; its config describes the typical call, so metadata is never empty.
    assert client.get_model_metadata("double")["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1]}]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
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
def test_infer_each_datatype(
    client: triton.InferenceServerClient, datatype: str, array: np.ndarray, binary: bool
) -> None:
    result = client.infer(
        "double",
        [_input("x", array, datatype, binary=binary)],
        outputs=[triton.InferRequestedOutput("x", binary_data=binary)],
        request_id="r1",
    )
    out = result.as_numpy("x")
    expected = array.copy() if array.dtype == np.bool_ else np.multiply(array, 2, dtype=array.dtype)
    assert out.dtype == array.dtype
    np.testing.assert_array_equal(out, expected)
    assert result.get_response()["id"] == "r1"


def test_infer_default_outputs_and_async(client: triton.InferenceServerClient) -> None:
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(client.infer("double", [_input("x", x, "FP32")]).as_numpy("x"), x * 2)
    pending = [
        client.async_infer("double", [_input("x", np.full(2, i, np.float32), "FP32")]) for i in range(6)
    ]
    for index, request in enumerate(pending):
        np.testing.assert_array_equal(request.get_result(timeout=10).as_numpy("x"), np.full(2, 2 * index))


def test_errors_map_to_statuses(client: triton.InferenceServerClient, http_address: str) -> None:
    with pytest.raises(InferenceServerException) as raised:
        client.infer("no-such-model", [_input("x", np.zeros(2, np.float32), "FP32")])
    assert raised.value.status() == "404" and "no-such-model" in raised.value.message()
    with httpx.Client(base_url=f"http://{http_address}", timeout=10) as http:
        wrong_count = {"inputs": [{"name": "x", "shape": [3], "datatype": "FP32", "data": [1, 2]}]}
        reply = http.post("/v2/models/double/infer", json=wrong_count)
        assert reply.status_code == 400 and "'x'" in reply.json()["error"]
        bad_type = {"inputs": [{"name": "x", "shape": [1], "datatype": "COMPLEX", "data": [1]}]}
        reply = http.post("/v2/models/double/infer", json=bad_type)
        assert reply.status_code == 400 and "COMPLEX" in reply.json()["error"]
        reply = http.post("/v2/models/double/infer", content=b"{not json")
        assert reply.status_code == 400
        reply = http.post(
            "/v2/models/double/infer",
            json={
                "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}],
                "parameters": {"priority": -1},
            },
        )
        assert reply.status_code == 400 and "priority" in reply.json()["error"]


def test_timeout_parameter_expires(http_address: str) -> None:
    body = {
        "inputs": [{"name": "ms", "shape": [1], "datatype": "FP32", "data": [1]}],
        "parameters": {"timeout": 50_000},  # 50 ms, in microseconds as in the v2 spec
    }
    blockers = [
        threading.Thread(
            target=httpx.post,
            args=(f"http://{http_address}/v2/models/sleep/infer",),
            kwargs={
                "json": {"inputs": [{"name": "ms", "shape": [1], "datatype": "FP32", "data": [600]}]},
                "timeout": 10,
            },
        )
        for _ in range(4)
    ]
    for thread in blockers:
        thread.start()
    time.sleep(0.1)  # let the four sleeps take every slot of `sleep`
    reply = httpx.post(f"http://{http_address}/v2/models/sleep/infer", json=body, timeout=10)
    for thread in blockers:
        thread.join(10)
    assert reply.status_code == 504, reply.text


def test_statistics(client: triton.InferenceServerClient) -> None:
    for _ in range(3):
        client.infer("double", [_input("x", np.ones(2, np.float32), "FP32")])
    deadline = time.monotonic() + 10
    while True:  # the services report to metrics every few hundred ms
        stats = client.get_inference_statistics("double")["model_stats"][0]
        success = int(stats.get("inference_stats", {}).get("success", {}).get("count", 0))
        if success >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert stats["name"] == "double" and success >= 3
    with pytest.raises(InferenceServerException) as raised:
        client.get_inference_statistics("no-such-model")
    assert raised.value.status() == "404"


def test_repository_index_unload_and_load(client: triton.InferenceServerClient) -> None:
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["double"]["state"] == "READY"
    client.unload_model("classifier")
    deadline = time.monotonic() + 30
    while client.is_model_ready("classifier") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not client.is_model_ready("classifier")
    client.load_model("classifier")
    deadline = time.monotonic() + 60
    while not client.is_model_ready("classifier") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.is_model_ready("classifier")


def test_disconnected_client_cancels_its_queued_request(
    http_address: str, queue_info: Callable[[str], scheduler_pb2.QueueInfo]
) -> None:
    done = threading.Event()

    def blocker() -> None:
        body = {"inputs": [{"name": "ms", "shape": [1], "datatype": "FP32", "data": [1500]}]}
        # `sleep` runs one call at a time at its worker: the last of eight ends after 12 s
        httpx.post(f"http://{http_address}/v2/models/sleep/infer", json=body, timeout=30)
        done.set()

    # `sleep` has 4 slots: 8 calls of 1.5 s fill them and the place behind each where the gateway
    # may stage one (a steady model's); the 9th waits in the queue until its client leaves.
    threads = [threading.Thread(target=blocker) for _ in range(8)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 5
    while queue_info("sleep").inflight < 4 and time.monotonic() < deadline:  # the slots are held
        time.sleep(0.02)
    time.sleep(0.5)  # every blocker runs, is staged, or waits (and is counted) by now
    before = queue_info("sleep").depth
    body = json.dumps({"inputs": [{"name": "ms", "shape": [1], "datatype": "FP32", "data": [1]}]}).encode()
    host, port = http_address.rsplit(":", 1)
    raw = socket.create_connection((host, int(port)), timeout=5)
    raw.sendall(
        b"POST /v2/models/sleep/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    deadline = time.monotonic() + 5
    while queue_info("sleep").depth < before + 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert queue_info("sleep").depth == before + 1, "the 9th request should wait behind eight 1.5 s sleeps"
    raw.close()
    deadline = time.monotonic() + 2
    while queue_info("sleep").depth > before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert queue_info("sleep").depth == before
    assert not done.is_set(), "the queue emptied because the client left, not because the sleeps ended"
    for thread in threads:
        thread.join(30)


def test_admin_queues_and_strategy_switch(http_address: str) -> None:
    with httpx.Client(base_url=f"http://{http_address}", timeout=10) as http:
        queues = http.get("/admin/queues")
        assert queues.status_code == 200
        current = queues.json()["strategy"]
        assert current and any(q["model"] == "double" for q in queues.json()["queues"])
        switched = http.post(
            "/admin/strategy", json={"strategy": current}
        )  # the same one: no change for others
        assert switched.status_code == 200, switched.text
        assert switched.json()["strategy"] == current and switched.json()["previous"] == current
        unknown = http.post("/admin/strategy", json={"strategy": "no-such-strategy"})
        assert unknown.status_code in (400, 404) and "no-such-strategy" in unknown.json()["error"]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_bytes_tensors_round_trip_through_echo(client: triton.InferenceServerClient, binary: bool) -> None:
    strings = np.array(["hello", "", "caf\u00e9"], dtype=np.object_)
    tensor = triton.InferInput("text", [3], "BYTES")
    tensor.set_data_from_numpy(strings, binary_data=binary)
    requested = [triton.InferRequestedOutput("text", binary_data=binary)]
    result = client.infer("echo", [tensor], outputs=requested)
    assert [value.decode() if isinstance(value, bytes) else value for value in result.as_numpy("text")] == [
        "hello",
        "",
        "caf\u00e9",
    ]


def test_nan_outputs_travel_as_binary_data_and_never_as_bare_json(
    client: triton.InferenceServerClient, http_address: str
) -> None:
    x = np.array([1.0, np.nan, np.inf], dtype=np.float32)
    as_binary = client.infer("double", [_input("x", x, "FP32")], outputs=[triton.InferRequestedOutput("x")])
    np.testing.assert_array_equal(as_binary.as_numpy("x"), x * 2)  # NaN and inf bit for bit
    head = json.dumps(
        {
            "inputs": [
                {"name": "x", "shape": [3], "datatype": "FP32", "parameters": {"binary_data_size": 12}}
            ],
            "outputs": [{"name": "x", "parameters": {"binary_data": False}}],
        }
    ).encode()
    reply = httpx.post(
        f"http://{http_address}/v2/models/double/infer",
        content=head + x.tobytes(),
        headers={"Inference-Header-Content-Length": str(len(head))},
        timeout=10,
    )
    assert reply.status_code == 400
    assert "output 'x' holds NaN or Infinity" in json.loads(reply.content)["error"]  # strict JSON
