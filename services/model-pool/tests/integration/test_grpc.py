"""The `ModelPool` gRPC service, health, and a clean shutdown."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadmaster.common.tensors import decode_tensors, encode_tensors
from loadmaster.model_pool.server import ModelPoolServer
from loadmaster.v1 import errors_pb2, model_pool_pb2, model_pool_pb2_grpc, tensor_pb2

READY = model_pool_pb2.MODEL_STATE_READY
IDLE = model_pool_pb2.MODEL_STATE_IDLE

BOOM = """
class Boom:
    def infer(self, inputs):
        raise ZeroDivisionError("division by zero in layer 3")
"""


@pytest.fixture
async def stub(worker: ModelPoolServer) -> Any:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        yield model_pool_pb2_grpc.ModelPoolServiceStub(channel), channel


async def test_health_and_status(worker: ModelPoolServer, stub: Any) -> None:
    pool, channel = stub
    health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    status = await pool.Status(model_pool_pb2.StatusRequest())
    assert status.worker_id == "worker-test" and status.data_endpoint == worker.data_endpoint
    assert {"classifier", "double", "policy", "policy-onnx", "sleep"} <= set(status.repository)
    by_id = {m.model_id: m for m in status.models}
    assert {m: by_id[m].state for m in ("double", "sleep", "policy")} == dict.fromkeys(
        ("double", "sleep", "policy"), READY
    )
    assert (
        by_id["policy"].vram_mb == 64 and by_id["policy"].device == "cpu" and by_id["policy"].load_time_ms > 0
    )


async def test_status_carries_the_declared_signatures_asked_for(stub: Any) -> None:
    pool, _ = stub
    status = await pool.Status(model_pool_pb2.StatusRequest(signatures_of=["policy", "double", "nope"]))
    by_id = {signature.model_id: signature for signature in status.signatures}
    assert set(by_id) == {"policy", "double"}  # not in the repository: left out
    policy = by_id["policy"]
    assert policy.backend == "torch"
    assert [(t.name, t.dtype, list(t.shape), t.any_shape) for t in policy.inputs] == [
        ("state", tensor_pb2.DTYPE_FLOAT32, [-1, 32], False)
    ]
    assert [(t.name, list(t.shape)) for t in policy.outputs] == [("action", [-1, 8])]
    # `double` takes any tensors; its config describes the typical call (enforce_inputs: false).
    assert [(t.name, list(t.shape)) for t in by_id["double"].inputs] == [("x", [-1])]
    assert not (await pool.Status(model_pool_pb2.StatusRequest())).signatures


async def test_infer_over_grpc(stub: Any) -> None:
    pool, _ = stub
    descriptors, payload = encode_tensors({"x": np.arange(3, dtype=np.int64)})
    reply = await pool.Infer(
        model_pool_pb2.InferRequest(model_id="double", inputs=descriptors, payload=bytes(payload))
    )
    assert reply.error_code == errors_pb2.ERROR_CODE_UNSPECIFIED, reply.error_message
    assert decode_tensors(reply.outputs, reply.payload)["x"].tolist() == [0, 2, 4]
    reply = await pool.Infer(model_pool_pb2.InferRequest(model_id="nope"))
    assert reply.error_code == errors_pb2.ERROR_CODE_NOT_FOUND and reply.payload == b""


async def test_load_and_unload(stub: Any) -> None:
    pool, _ = stub
    unloaded = await pool.Unload(model_pool_pb2.UnloadRequest(model_id="double"))
    assert unloaded.model.state == IDLE
    descriptors, payload = encode_tensors({"x": np.ones(1, np.float32)})
    request = model_pool_pb2.InferRequest(model_id="double", inputs=descriptors, payload=bytes(payload))
    reply = await pool.Infer(request)
    assert reply.error_code == errors_pb2.ERROR_CODE_UNAVAILABLE and reply.retryable
    loaded = await pool.Load(model_pool_pb2.LoadRequest(model_id="double"))
    assert loaded.model.state == READY and loaded.model.generation == 2
    assert (await pool.Infer(request)).generation == 2
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await pool.Load(model_pool_pb2.LoadRequest(model_id="nope"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await pool.Load(model_pool_pb2.LoadRequest(model_id="classifier"))  # no artifact in this repository
    assert (
        caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "make models" in caught.value.details()
    )
    status = await pool.Status(model_pool_pb2.StatusRequest())
    classifier = next(m for m in status.models if m.model_id == "classifier")
    assert classifier.state == IDLE and "make models" in classifier.error


async def test_engine_exception_is_an_internal_reply(
    tmp_path: Path, leases: Any, start_worker: Any, make_client: Any
) -> None:
    (tmp_path / "boom").mkdir()
    (tmp_path / "boom" / "config.yaml").write_text("backend: python\nclass: Boom\n")
    (tmp_path / "boom" / "model.py").write_text(BOOM)
    async with start_worker(tmp_path, preload=["boom"], lease_client=leases) as worker:
        client = make_client(worker.data_endpoint)
        reply, _ = await client.call("boom", {"x": np.ones(1, np.float32)})
        assert reply.error_code == errors_pb2.ERROR_CODE_INTERNAL and not reply.retryable
        assert "division by zero in layer 3" in reply.error_message
        reply, _ = await client.call("boom", {"x": np.ones(1, np.float32)})
        assert reply.error_code == errors_pb2.ERROR_CODE_INTERNAL  # still serving


async def test_shutdown_finishes_in_flight_and_refuses_new_work(
    example_repo: Path, leases: Any, start_worker: Any, make_client: Any
) -> None:
    stopped = False
    async with start_worker(example_repo, preload=["double", "sleep"], lease_client=leases) as worker:
        client = make_client(worker.data_endpoint)
        assert len(leases.held) == 2
        await client.send(*client.request("sleep", {"ms": np.array([400], np.float32)}, request_id="slow"))
        await asyncio.sleep(0.05)
        stopping = asyncio.create_task(worker.stop())
        await asyncio.sleep(0.05)
        reply, _ = await client.call("double", {"x": np.ones(1, np.float32)})
        assert reply.error_code == errors_pb2.ERROR_CODE_UNAVAILABLE and reply.retryable
        assert "shutting down" in reply.error_message
        slow, _ = await client.receive()
        assert slow.request_id == "slow" and slow.error_code == errors_pb2.ERROR_CODE_UNSPECIFIED
        await stopping
        stopped = True
        assert leases.held == set() and len(leases.released) == 2
        assert not leases.closed  # an injected client belongs to the caller
    assert stopped


async def test_a_load_may_set_the_models_keep_alive(worker: ModelPoolServer, stub: Any) -> None:
    pool, _ = stub
    await pool.Load(model_pool_pb2.LoadRequest(model_id="sleep", keep_alive_s=120))
    assert worker.pool.status("sleep").keep_alive_s == 120.0
    await pool.Load(model_pool_pb2.LoadRequest(model_id="sleep", keep_alive_s=-1))  # Ollama's keep_alive -1
    assert worker.pool.status("sleep").keep_alive_s is None  # never unloaded for idleness
