"""A real worker whose model is served by a real engine process: `transformers serve` on the
`tiny-chat` folder (examples/models/tiny-chat-process), on CPU, under a lease of the real
gpu-broker. Streams go through the worker's ZMQ data port as the gateway sends them: chat
and text prompts are proxied and stream back as chunks; killing the engine fails the stream
in flight with its exit status and leaves the slot IDLE; the next load starts it again;
unloading (here: eviction for a model that needs the memory) stops the whole process group
before the lease is released."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest
import zmq
import zmq.asyncio

from loadmaster.common.framing import GENERATE_REPLIES_FRAME, GENERATE_REQUEST_FRAME
from loadmaster.model_pool.engines.openai_process import OpenAIProcessEngine
from loadmaster.model_pool.generation_wire import StreamOrder
from loadmaster.model_pool.slots import ModelState
from loadmaster.v1 import gpu_broker_pb2, model_pool_pb2

if TYPE_CHECKING:
    from conftest import BrokerAt

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
MODEL = "tiny-chat-process"

pytestmark = pytest.mark.skipif(
    shutil.which("transformers") is None and not (Path(os.sys.executable).with_name("transformers")).exists(),
    reason="`transformers serve` is not installed (loadmaster-model-pool[openai_process])",
)


@pytest.fixture(scope="module")
def process_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-chat's artifacts beside the tiny-chat-process config that points at them."""
    root = tmp_path_factory.mktemp("engine") / "models"
    built = EXAMPLES / "models" / "tiny-chat" / "artifacts"
    if not (built / "config.json").is_file():
        pytest.skip("tiny-chat is not built (make models)")
    shutil.copytree(built, root / "tiny-chat" / "artifacts")
    (root / MODEL).mkdir()
    shutil.copy(EXAMPLES / "models" / MODEL / "config.yaml", root / MODEL / "config.yaml")
    shutil.copytree(EXAMPLES / "models" / "double", root / "big-double")  # needs the engine's memory
    config = (root / "big-double" / "config.yaml").read_text()
    (root / "big-double" / "config.yaml").write_text(config.replace("vram_mb: 16", "vram_mb: 64"))
    return root


class Streams:
    """A gateway-like DEALER: sends GenerateRequests, checks and collects the replies."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.replies: dict[str, list[model_pool_pb2.GenerateReply]] = {}
        self.order: dict[str, StreamOrder] = {}
        self.arrived = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            assert frames[0] == GENERATE_REPLIES_FRAME
            for reply in model_pool_pb2.GenerateReplies.FromString(frames[1]).replies:
                self.order.setdefault(reply.request_id, StreamOrder()).accept(reply)  # raises on a gap
                self.replies.setdefault(reply.request_id, []).append(reply)
            self.arrived.set()

    async def generate(self, request_id: str, *, max_tokens: int, **prompt: Any) -> None:
        request = model_pool_pb2.GenerateRequest(
            request_id=request_id,
            model_id=MODEL,
            sampling=model_pool_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
            **prompt,
        )
        await self.socket.send_multipart([GENERATE_REQUEST_FRAME, request.SerializeToString()])

    async def until(self, condition: Any, timeout_s: float = 60.0) -> None:
        async def wait() -> None:
            while not condition():
                self.arrived.clear()
                await self.arrived.wait()

        await asyncio.wait_for(wait(), timeout_s)

    def ended(self, request_id: str) -> bool:
        return self.order.get(request_id, StreamOrder()).finished

    def text(self, request_id: str) -> str:
        return "".join(r.chunk.text for r in self.replies.get(request_id, []) if r.HasField("chunk"))

    def terminal(self, request_id: str) -> model_pool_pb2.GenerateReply:
        return self.replies[request_id][-1]

    async def close(self) -> None:
        self._reader.cancel()
        self.socket.close()
        self.context.term()


@pytest.fixture
async def streams_to() -> AsyncIterator[Any]:
    opened: list[Streams] = []

    def open_(endpoint: str) -> Streams:
        opened.append(Streams(endpoint))
        return opened[-1]

    yield open_
    for streams in opened:
        await streams.close()


def _group_alive(pgid: int) -> bool:
    """A process of group `pgid` still runs (a zombie that init has not reaped yet does not)."""
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


async def _until(condition: Any, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.05)


def _engine(worker: Any) -> OpenAIProcessEngine:
    engine = worker.pool._loaded[MODEL].instances[0].engine
    assert isinstance(engine, OpenAIProcessEngine)
    return engine


async def test_engine_process_streams_then_is_evicted_and_stopped_before_its_lease_is_released(
    real_broker: BrokerAt, process_repo: Path, start_worker: Any, streams_to: Any
) -> None:
    async with (
        real_broker(total_mb=100) as (address, stub),  # room for one of the two 64 MB models
        start_worker(process_repo, preload=[], broker_address=address) as worker,
    ):
        await worker.pool.load(MODEL)
        status = worker.pool.status(MODEL)
        assert status.state is ModelState.READY and status.backend == "openai_process"
        engine = _engine(worker)
        pid = engine.pid
        assert pid is not None and os.getpgid(pid) == pid  # a session (process group) of its own
        leases = (await stub.ListLeases(gpu_broker_pb2.ListLeasesRequest(holder="worker-test"))).leases
        assert [(lease.labels["model"], sum(lease.mb_per_gpu.values())) for lease in leases] == [(MODEL, 64)]

        streams = streams_to(worker.data_endpoint)
        chat = model_pool_pb2.ChatMessages(messages=[model_pool_pb2.ChatMessage(role="user", content="hi")])
        await streams.generate("chat", max_tokens=6, messages=chat)
        await streams.generate("text", max_tokens=5, prompt_text="hello there")
        await streams.until(lambda: streams.ended("chat") and streams.ended("text"))
        for request_id, tokens in (("chat", 6), ("text", 5)):
            end = streams.terminal(request_id)
            assert end.HasField("result"), end
            assert end.result.finish_reason == model_pool_pb2.FINISH_REASON_LENGTH
            assert end.result.usage.completion_tokens == tokens
            assert end.result.usage.prompt_tokens > 0
            assert len(streams.replies[request_id]) >= 2 and streams.text(request_id)
        assert worker.pool.status(MODEL).inflight == 0

        released: list[bool] = []  # was the group gone when the broker saw the release?
        original = worker.pool._lease_client.release

        async def release(lease: Any) -> None:
            released.append(not _group_alive(pid))
            await original(lease)

        worker.pool._lease_client.release = release
        await worker.pool.load("big-double")  # does not fit beside the engine: evicts it
        assert released == [True]
        assert not _group_alive(pid)
        status = worker.pool.status(MODEL)
        assert status.state is ModelState.IDLE and status.evictions == 1
        leases = (await stub.ListLeases(gpu_broker_pb2.ListLeasesRequest(holder="worker-test"))).leases
        assert [lease.labels["model"] for lease in leases] == ["big-double"]


@pytest.mark.slow
async def test_a_killed_engine_fails_its_stream_goes_idle_and_loads_again(
    real_broker: BrokerAt, process_repo: Path, start_worker: Any, streams_to: Any
) -> None:
    async with (
        real_broker() as (address, stub),
        start_worker(process_repo, preload=[], broker_address=address) as worker,
    ):
        await worker.pool.load(MODEL)
        pid = _engine(worker).pid
        assert pid is not None
        streams = streams_to(worker.data_endpoint)
        await streams.generate("long", max_tokens=3000, prompt_text="hello")
        await streams.until(lambda: len(streams.replies.get("long", [])) >= 2)
        os.killpg(pid, signal.SIGKILL)

        await streams.until(lambda: streams.ended("long"))
        end = streams.terminal("long")
        assert end.HasField("error"), end
        assert "exited with status -9" in end.error.error_message
        await _until(lambda: worker.pool.status(MODEL).state is ModelState.IDLE)
        assert "exited with status -9" in worker.pool.status(MODEL).error
        leases = (await stub.ListLeases(gpu_broker_pb2.ListLeasesRequest(holder="worker-test"))).leases
        assert list(leases) == []

        await worker.pool.load(MODEL)  # the next request's load: a new engine process
        new_pid = _engine(worker).pid
        assert new_pid is not None and new_pid != pid
        await streams.generate("after", max_tokens=3, prompt_text="hello")
        await streams.until(lambda: streams.ended("after"))
        assert streams.terminal("after").HasField("result")
        await worker.pool.unload(MODEL)
        assert not _group_alive(new_pid)
