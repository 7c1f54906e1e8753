"""A real worker with a `remote_openai` model: an OpenAI-compatible server on 127.0.0.1 stands in
for the hosted API (tests/unit/openai_stub.py). The model loads without a GPU lease (the real
gpu-broker lists none), streams chat and text through the worker's data port with the key from
`api_key_file`, and a wrong key or an unreachable API fails the load instead of the requests."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import zmq
import zmq.asyncio
from openai_stub import OpenAIStub

from loadmaster.common.errors import FailedPreconditionError, UnavailableError
from loadmaster.common.framing import GENERATE_REPLIES_FRAME, GENERATE_REQUEST_FRAME
from loadmaster.common.ports import free_port
from loadmaster.model_pool.generation_wire import StreamOrder
from loadmaster.model_pool.slots import ModelState
from loadmaster.v1 import gpu_broker_pb2, model_pool_pb2

if TYPE_CHECKING:
    from conftest import BrokerAt

MODEL = "cloud-chat"


def _repo(root: Path, base_url: str, *, key: str | None) -> Path:
    folder = root / MODEL
    folder.mkdir(parents=True)
    lines = ["backend: remote_openai", f"base_url: {base_url}", "remote_model: big-cloud-model"]
    if key is not None:
        (folder / "api.key").write_text(key + "\n")
        lines.append("api_key_file: api.key")
    (folder / "config.yaml").write_text("\n".join(lines) + "\n")
    return root


async def _generate(
    endpoint: str, requests: dict[str, model_pool_pb2.GenerateRequest]
) -> dict[str, list[Any]]:
    """Send `requests` as the gateway does; every reply of each, checked for order, until all ended."""
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    replies: dict[str, list[Any]] = {request_id: [] for request_id in requests}
    orders = {request_id: StreamOrder() for request_id in requests}
    try:
        for request in requests.values():
            await socket.send_multipart([GENERATE_REQUEST_FRAME, request.SerializeToString()])
        async with asyncio.timeout(30):
            while not all(order.finished for order in orders.values()):
                frames = await socket.recv_multipart()
                assert frames[0] == GENERATE_REPLIES_FRAME
                for reply in model_pool_pb2.GenerateReplies.FromString(frames[1]).replies:
                    orders[reply.request_id].accept(reply)  # raises on a gap or a repeat
                    replies[reply.request_id].append(reply)
    finally:
        socket.close()
        context.term()
    return replies


def _request(request_id: str, *, max_tokens: int, **prompt: Any) -> model_pool_pb2.GenerateRequest:
    sampling = model_pool_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return model_pool_pb2.GenerateRequest(request_id=request_id, model_id=MODEL, sampling=sampling, **prompt)


def _text(replies: list[Any]) -> str:
    return "".join(r.chunk.text for r in replies if r.HasField("chunk"))


async def test_a_remote_model_streams_through_the_worker_without_a_lease(
    real_broker: BrokerAt, tmp_path: Path, start_worker: Any
) -> None:
    with OpenAIStub(key="sk-right", reply="one two three four five six") as remote:
        repo = _repo(tmp_path / "models", remote.base_url, key="sk-right")
        async with (
            real_broker(total_mb=100) as (address, stub),
            start_worker(repo, preload=[], broker_address=address) as worker,
        ):
            await worker.pool.load(MODEL)
            status = worker.pool.status(MODEL)
            assert status.state is ModelState.READY and status.backend == "remote_openai"
            assert status.vram_mb == 0 and status.device == "remote"
            leases = (await stub.ListLeases(gpu_broker_pb2.ListLeasesRequest(holder="worker-test"))).leases
            assert list(leases) == []  # no GPU memory taken for a hosted API

            chat = model_pool_pb2.ChatMessages(
                messages=[model_pool_pb2.ChatMessage(role="user", content="hi")]
            )
            replies = await _generate(
                worker.data_endpoint,
                {
                    "chat": _request("chat", max_tokens=4, messages=chat),
                    "text": _request("text", max_tokens=50, prompt_text="hello"),
                },
            )
            chat_end, text_end = replies["chat"][-1], replies["text"][-1]
            assert _text(replies["chat"]) == "one two three four "
            assert chat_end.result.finish_reason == model_pool_pb2.FINISH_REASON_LENGTH
            assert chat_end.result.usage.completion_tokens == 4
            assert _text(replies["text"]) == "one two three four five six "
            assert text_end.result.finish_reason == model_pool_pb2.FINISH_REASON_STOP
            assert [r["model"] for r in remote.requests] == ["big-cloud-model"] * 2
            assert {r["authorization"] for r in remote.requests} == {"Bearer sk-right"}
            assert all(r["stream"] is True for r in remote.requests)

            await worker.pool.unload(MODEL)
            assert worker.pool.status(MODEL).state is ModelState.IDLE


async def test_a_wrong_key_or_an_unreachable_api_fails_the_load(tmp_path: Path, start_worker: Any) -> None:
    with OpenAIStub(key="sk-right") as remote:
        repo = _repo(tmp_path / "wrong", remote.base_url, key="sk-wrong")
        async with start_worker(repo, preload=[]) as worker:
            with pytest.raises(FailedPreconditionError, match="refused the key"):
                await worker.pool.load(MODEL)
            assert worker.pool.status(MODEL).state is ModelState.IDLE
            assert "refused the key" in worker.pool.status(MODEL).error
            assert "sk-wrong" not in worker.pool.status(MODEL).error  # the key is never shown
    nowhere = _repo(tmp_path / "nowhere", f"http://127.0.0.1:{free_port()}/v1", key=None)
    async with start_worker(nowhere, preload=[]) as worker:
        with pytest.raises(UnavailableError, match="cannot be reached"):
            await worker.pool.load(MODEL)
