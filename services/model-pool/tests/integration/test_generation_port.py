"""Generation streams on a real worker's ZMQ data port with `tiny-chat` (backend transformers):
order and exactly-once, chunks of one loop turn in one message, the admission held for the
stream's life, cancel, bad input, a waiting stream's progress replies, and a priority-0 one
pausing a low-priority sequence (max_sequences 2 here, so two streams fill the model)."""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from loadmaster.common import internal_auth
from loadmaster.common.credentials import Credentials, Identity
from loadmaster.common.framing import GENERATE_CANCEL_FRAME, GENERATE_REPLIES_FRAME, GENERATE_REQUEST_FRAME
from loadmaster.model_pool.generation_wire import StreamOrder
from loadmaster.model_pool.server import ModelPoolServer
from loadmaster.model_pool.slots import ModelState
from loadmaster.v1 import errors_pb2, model_pool_pb2

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def chat_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-chat with 2 sequences, so a test fills the model with two streams."""
    root = tmp_path_factory.mktemp("chat") / "models"
    folder = root / MODEL
    folder.mkdir(parents=True)
    config = (EXAMPLES / "models" / MODEL / "config.yaml").read_text()
    (folder / "config.yaml").write_text(
        config.replace("max_sequences: 32", "max_sequences: 2").replace(
            "max_resident_sequences: 64", "max_resident_sequences: 2"
        )
    )
    built = EXAMPLES / "models" / MODEL / "artifacts"
    if (built / "config.json").is_file():
        shutil.copytree(built, folder / "artifacts")
    else:
        spec = importlib.util.spec_from_file_location("_lm_make_models_gen", EXAMPLES / "make_models.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.build([MODEL], root=root)
        (folder / "config.yaml").write_text(
            config.replace("max_sequences: 32", "max_sequences: 2").replace(
                "max_resident_sequences: 64", "max_resident_sequences: 2"
            )
        )
    return root


class Streams:
    """A gateway-like DEALER that sends generation messages and sorts replies per request."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.replies: dict[str, list[model_pool_pb2.GenerateReply]] = {}
        self.messages: list[int] = []  # replies per GenerateReplies message
        self.order: dict[str, StreamOrder] = {}
        self.first_chunks: list[str] = []  # requests in the order their first chunk came
        self.arrived = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            assert frames[0] == GENERATE_REPLIES_FRAME and len(frames) == 2, frames
            message = model_pool_pb2.GenerateReplies.FromString(frames[1])
            self.messages.append(len(message.replies))
            for reply in message.replies:
                self.order.setdefault(reply.request_id, StreamOrder()).accept(reply)  # raises on a gap
                if reply.HasField("chunk") and reply.request_id not in self.first_chunks:
                    self.first_chunks.append(reply.request_id)
                self.replies.setdefault(reply.request_id, []).append(reply)
            self.arrived.set()

    async def generate(self, request_id: str, **fields: Any) -> None:
        sampling = fields.pop("sampling", None) or model_pool_pb2.SamplingParams(
            max_tokens=8, temperature=0.0
        )
        if "messages" not in fields and "prompt_text" not in fields:
            fields["prompt_text"] = "hello there"
        request = model_pool_pb2.GenerateRequest(
            request_id=request_id, model_id=MODEL, sampling=sampling, **fields
        )
        await self.socket.send_multipart([GENERATE_REQUEST_FRAME, request.SerializeToString()])

    async def cancel(self, request_id: str, metadata: dict[str, str] | None = None) -> None:
        message = model_pool_pb2.CancelGeneration(
            request_id=request_id, model_id=MODEL, reason="gone", metadata=metadata or {}
        )
        await self.socket.send_multipart([GENERATE_CANCEL_FRAME, message.SerializeToString()])

    async def until(self, condition: Any, timeout_s: float = 30.0) -> None:
        async def wait() -> None:
            while not condition():
                self.arrived.clear()
                await self.arrived.wait()

        await asyncio.wait_for(wait(), timeout_s)

    def ended(self, request_id: str) -> bool:
        return self.order.get(request_id, StreamOrder()).finished

    def terminal(self, request_id: str) -> model_pool_pb2.GenerateReply:
        assert self.ended(request_id)
        return self.replies[request_id][-1]

    def tokens(self, request_id: str) -> list[int]:
        return [t for r in self.replies.get(request_id, []) if r.HasField("chunk") for t in r.chunk.token_ids]

    async def close(self) -> None:
        self._reader.cancel()
        self.socket.close()
        self.context.term()


@pytest.fixture
async def chat_worker(
    chat_repo: Path, start_worker: Any, leases: Any
) -> AsyncIterator[tuple[ModelPoolServer, Streams]]:
    async with start_worker(chat_repo, preload=[MODEL], lease_client=leases) as worker:
        streams = Streams(worker.data_endpoint)
        try:
            yield worker, streams
        finally:
            await streams.close()


def sampling(max_tokens: int) -> model_pool_pb2.SamplingParams:
    return model_pool_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)


async def test_a_stream_is_ordered_counted_and_holds_its_admission(
    chat_worker: tuple[ModelPoolServer, Streams],
) -> None:
    worker, streams = chat_worker
    await streams.generate("a", sampling=sampling(400))
    await streams.until(lambda: len(streams.replies.get("a", [])) >= 1)
    assert worker.pool.status(MODEL).inflight == 1  # admitted for the stream's life
    await streams.until(lambda: streams.ended("a"))
    end = streams.terminal("a")
    assert end.HasField("result"), end
    assert end.result.finish_reason == model_pool_pb2.FINISH_REASON_LENGTH
    assert end.result.usage.completion_tokens == 400 == len(streams.tokens("a"))
    assert end.result.time_to_first_token_ms > 0
    assert worker.pool.status(MODEL).inflight == 0
    # 400 tokens in fewer messages than replies: what one loop turn made travelled together
    # (with two streams in the batch, each step's chunks share a message).
    await streams.generate("b", sampling=sampling(64))
    await streams.generate("c", sampling=sampling(64))
    await streams.until(lambda: streams.ended("b") and streams.ended("c"))
    assert streams.tokens("b") == streams.tokens("c") == streams.tokens("a")[:64]  # greedy: the same
    assert max(streams.messages) >= 2


async def test_cancel_frees_the_sequence_and_is_answered_once(
    chat_worker: tuple[ModelPoolServer, Streams],
) -> None:
    worker, streams = chat_worker
    await streams.generate("long", sampling=sampling(1500))
    await streams.until(lambda: len(streams.replies.get("long", [])) >= 2)
    await streams.cancel("long")
    await streams.cancel("long")  # idempotent
    await streams.until(lambda: streams.ended("long"))
    end = streams.terminal("long")
    assert end.HasField("cancelled") and end.cancelled.usage.completion_tokens >= 1
    assert worker.data_port.generations.sequences(MODEL) == (0, 0)
    assert worker.pool.status(MODEL).inflight == 0
    await streams.cancel("unknown")  # a no-op, answered by nothing
    await streams.generate("after", sampling=sampling(4))
    await streams.until(lambda: streams.ended("after"))
    assert list(streams.replies) == ["long", "after"]


async def test_bad_input_is_one_error_reply_naming_the_field(
    chat_worker: tuple[ModelPoolServer, Streams],
) -> None:
    _, streams = chat_worker
    bad_role = model_pool_pb2.ChatMessages(messages=[model_pool_pb2.ChatMessage(role="robot", content="hi")])
    await streams.generate("role", messages=bad_role)
    await streams.generate("zero", sampling=model_pool_pb2.SamplingParams(max_tokens=0))
    await streams.generate("long", prompt_text="word " * 5000, sampling=sampling(16))
    await streams.until(lambda: all(streams.ended(r) for r in ("role", "zero", "long")))
    for request_id, needle in (("role", "messages[0].role"), ("zero", "max_tokens"), ("long", "context")):
        [reply] = streams.replies[request_id]
        assert reply.sequence == 0 and reply.error.error_code == errors_pb2.ERROR_CODE_INVALID_ARGUMENT
        assert needle in reply.error.error_message and not reply.error.retryable
    assert "(2048 tokens)" in streams.replies["long"][0].error.error_message


async def test_a_priority_0_stream_pauses_the_lowest_priority_sequence_keeping_its_cache(
    chat_worker: tuple[ModelPoolServer, Streams],
) -> None:
    worker, streams = chat_worker
    port = worker.data_port.generations
    engine = worker.pool._loaded[MODEL].instances[0].engine
    before = engine.scheduling()
    await streams.generate("solo", sampling=sampling(300), priority=2)  # the uninterrupted reference
    await streams.until(lambda: streams.ended("solo"))
    await streams.generate("low-old", sampling=sampling(300), priority=2)
    await streams.generate("low-new", sampling=sampling(300), priority=2)
    await streams.until(lambda: len(streams.tokens("low-new")) >= 8 and len(streams.tokens("low-old")) >= 8)
    assert port.sequences(MODEL) == (2, 0)
    await streams.generate("urgent", sampling=sampling(16), priority=0)
    await streams.until(lambda: streams.ended("urgent"))
    # served while both low-priority streams were still unfinished: it took the newest one's place
    assert not streams.ended("low-old") and not streams.ended("low-new")
    assert streams.terminal("urgent").result.usage.completion_tokens == 16
    await streams.until(lambda: streams.ended("low-old") and streams.ended("low-new"))
    after = engine.scheduling()
    assert (after.preemptions - before.preemptions, after.resumes - before.resumes) == (1, 1)
    assert after.kv_recomputed == before.kv_recomputed  # it kept its cache while paused
    # resumed without losing or repeating a token. (Compared over the first 100 tokens, past
    # the pause: far into a random model's output, batches of other shapes round differently
    # and a near-tie can flip; docs/generative.md, "Limits".)
    assert len(streams.tokens("low-new")) == 300
    assert streams.tokens("low-new")[:100] == streams.tokens("low-old")[:100] == streams.tokens("solo")[:100]
    assert port.sequences(MODEL) == (0, 0) and worker.pool.status(MODEL).inflight == 0


async def test_a_waiting_stream_is_told_its_place_before_its_first_token(
    chat_worker: tuple[ModelPoolServer, Streams],
) -> None:
    _, streams = chat_worker
    for name in ("busy-1", "busy-2"):  # fill both places with priority 0 (never paused)
        await streams.generate(name, sampling=sampling(1500), priority=0)
    await streams.until(lambda: len(streams.tokens("busy-1")) >= 1 and len(streams.tokens("busy-2")) >= 1)
    await streams.generate("waits", sampling=sampling(4), priority=1)
    await streams.until(lambda: any(r.HasField("progress") for r in streams.replies.get("waits", [])))
    [progress] = [r for r in streams.replies["waits"] if r.HasField("progress")]
    assert progress.progress.queued_ahead == 0 and progress.sequence == 0
    for name in ("busy-1", "busy-2"):
        await streams.cancel(name)
    await streams.until(lambda: streams.ended("waits"))
    assert streams.terminal("waits").result.usage.completion_tokens == 4


async def test_streams_beyond_the_sequences_wait_in_priority_order(
    chat_worker: tuple[ModelPoolServer, Streams],
) -> None:
    _, streams = chat_worker
    # Priority 0: never preempted. Different lengths, so the sequences free one at a time (two
    # freed in the same engine step start both waiters in one step, their first replies in
    # whichever order the engine emits them, which says nothing about priority).
    for name, tokens in (("run-1", 200), ("run-2", 400)):
        await streams.generate(name, sampling=sampling(tokens), priority=0)
    await streams.until(lambda: len(streams.tokens("run-1")) >= 1 and len(streams.tokens("run-2")) >= 1)
    await streams.generate("wait-low", sampling=sampling(8), priority=3)
    await streams.generate("wait-high", sampling=sampling(8), priority=1)
    await streams.until(lambda: streams.ended("wait-low") and streams.ended("wait-high"))
    order = streams.first_chunks  # (progress replies may come first: a waiting stream's place)
    assert order.index("wait-high") < order.index("wait-low")


async def test_with_internal_credentials_only_signed_messages_are_obeyed(
    chat_worker: tuple[ModelPoolServer, Streams],
) -> None:
    worker, streams = chat_worker
    secret = b"s" * 32
    gateway = Credentials(secret, Identity.parse("gateway/g1"))
    internal_auth.setup(Credentials(secret, Identity.parse("model-pool/worker-test")))
    try:
        await streams.generate("unsigned", sampling=sampling(4))
        signed: dict[str, str] = {}
        gateway.sign_envelope(signed, "signed")
        await streams.generate("signed", sampling=sampling(1500), metadata=signed)
        await streams.until(lambda: streams.ended("unsigned") and len(streams.tokens("signed")) >= 2)
        [refused] = streams.replies["unsigned"]
        assert refused.error.error_code == errors_pb2.ERROR_CODE_UNAUTHENTICATED
        await streams.cancel("signed")  # unsigned: ignored
        cancel: dict[str, str] = {}
        gateway.sign_envelope(cancel, "signed")  # signed over the wrong text: ignored too
        await streams.cancel("signed", cancel)
        await asyncio.sleep(0.2)
        assert not streams.ended("signed")
        cancel = {}
        gateway.sign_envelope(cancel, "cancel:signed")
        await streams.cancel("signed", cancel)
        await streams.until(lambda: streams.ended("signed"))
        assert streams.terminal("signed").HasField("cancelled")
        assert worker.pool.status(MODEL).inflight == 0
    finally:
        internal_auth.setup(None)


async def test_a_model_whose_batching_thread_died_is_unloaded_not_left_failing(
    chat_worker: tuple[ModelPoolServer, Streams],
) -> None:
    worker, streams = chat_worker
    engine = worker.pool._loaded[MODEL].instances[0].engine
    await asyncio.to_thread(engine._manager.stop, block=True, hard_stop=True)  # as if it crashed
    await streams.generate("after-crash", sampling=sampling(4))
    await streams.until(lambda: streams.ended("after-crash"))
    [reply] = streams.replies["after-crash"]
    assert reply.error.error_code == errors_pb2.ERROR_CODE_UNAVAILABLE and reply.error.retryable
    for _ in range(100):  # bounded: the unload runs in the background
        if worker.pool.status(MODEL).state is ModelState.IDLE:
            break
        await asyncio.sleep(0.05)
    assert worker.pool.status(MODEL).state is ModelState.IDLE


async def test_images_to_a_model_that_takes_none_and_a_requests_keep_alive(
    chat_worker: tuple[ModelPoolServer, Streams],
) -> None:
    worker, streams = chat_worker
    with_image = model_pool_pb2.ChatMessages(
        messages=[model_pool_pb2.ChatMessage(role="user", content="what?", images=[b"\x89PNG\r\n\x1a\n..."])]
    )
    await streams.generate("image", messages=with_image)
    await streams.until(lambda: streams.ended("image"))
    [reply] = streams.replies["image"]
    assert reply.error.error_code == errors_pb2.ERROR_CODE_INVALID_ARGUMENT
    assert reply.error.error_message == (
        "model 'tiny-chat' takes no images: send text only, or ask a vision-language model"
    )
    assert worker.pool.status(MODEL).inflight == 0
    await streams.generate("kept", sampling=sampling(2), keep_alive_s=-1.0)  # Ollama's keep_alive -1
    await streams.until(lambda: streams.ended("kept"))
    assert worker.pool.status(MODEL).keep_alive_s is None
    await streams.generate("brief", sampling=sampling(2), keep_alive_s=600.0)
    await streams.until(lambda: streams.ended("brief"))
    assert worker.pool.status(MODEL).keep_alive_s == 600.0


async def test_a_stream_still_waiting_at_its_deadline_is_answered_expired(
    chat_worker: tuple[ModelPoolServer, Streams],
) -> None:
    _, streams = chat_worker
    for name in ("hold-1", "hold-2"):  # both places, priority 0: nothing pauses for the next one
        await streams.generate(name, sampling=sampling(1500), priority=0)
    await streams.until(lambda: len(streams.tokens("hold-1")) >= 1 and len(streams.tokens("hold-2")) >= 1)
    deadline = int((time.time() + 0.6) * 1e9)
    await streams.generate("late", sampling=sampling(4), priority=1, deadline_unix_ns=deadline)
    await streams.until(lambda: streams.ended("late"))
    reply = streams.terminal("late")
    assert reply.error.error_code == errors_pb2.ERROR_CODE_EXPIRED and "deadline" in reply.error.error_message
    assert time.time() * 1e9 >= deadline
    for name in ("hold-1", "hold-2"):
        await streams.cancel(name)
    await streams.until(lambda: streams.ended("hold-1") and streams.ended("hold-2"))
