"""Prefix reuse with `tiny-chat` (block_size 64) and transformers' real paged cache: a second
chat with the same long system prompt reuses its KV pages, says so in the engine's counters and
the worker's metrics, and answers exactly what an engine without prefix caching answers."""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from loadmaster.common.framing import GENERATE_REPLIES_FRAME, GENERATE_REQUEST_FRAME
from loadmaster.model_pool.engines import EngineContext
from loadmaster.model_pool.engines.transformers import TransformersEngine
from loadmaster.model_pool.generation import (
    ChatMessage,
    GenerationEnd,
    GenerationRequest,
    SamplingParams,
    TokenChunk,
)
from loadmaster.model_pool.generation_wire import StreamOrder
from loadmaster.model_pool.repository import ModelRepository
from loadmaster.v1 import model_pool_pb2

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
MODEL = "tiny-chat"
SYSTEM = " ".join(f"Rule {i}: keep every robot arm inside its fence." for i in range(40))  # ~500 tokens
OTHER_SYSTEM = " ".join(f"Note {i}: the gripper opens slowly." for i in range(40))


@pytest.fixture(scope="module")
def chat_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-chat as its example config has it, and a copy with prefix caching off."""
    root = tmp_path_factory.mktemp("prefix") / "models"
    folder = root / MODEL
    folder.mkdir(parents=True)
    config = (EXAMPLES / "models" / MODEL / "config.yaml").read_text()
    (folder / "config.yaml").write_text(config)
    built = EXAMPLES / "models" / MODEL / "artifacts"
    if (built / "config.json").is_file():
        shutil.copytree(built, folder / "artifacts")
    else:
        spec = importlib.util.spec_from_file_location("_lm_make_models_prefix", EXAMPLES / "make_models.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.build([MODEL], root=root)
    off = root / "tiny-chat-no-prefix"
    off.mkdir()
    (off / "config.yaml").write_text(config + "prefix_caching: false\n")
    shutil.copytree(folder / "artifacts", off / "artifacts")
    return root


def _engine(repo: Path, model_id: str) -> Iterator[TransformersEngine]:
    engine = TransformersEngine(ModelRepository(repo).spec(model_id), EngineContext(device="cpu", threads=1))
    engine.load()
    engine.warmup()
    try:
        yield engine
    finally:
        engine.unload()


@pytest.fixture(scope="module")
def engine(chat_repo: Path) -> Iterator[TransformersEngine]:
    yield from _engine(chat_repo, MODEL)


@pytest.fixture(scope="module")
def engine_without_reuse(chat_repo: Path) -> Iterator[TransformersEngine]:
    yield from _engine(chat_repo, "tiny-chat-no-prefix")


def chat(request_id: str, system: str, question: str) -> GenerationRequest:
    return GenerationRequest(
        request_id,
        SamplingParams(max_tokens=12, temperature=0.0),
        messages=(ChatMessage("system", system), ChatMessage("user", question)),
    )


async def greedy(engine: TransformersEngine, request: GenerationRequest) -> tuple[list[int], int]:
    """(the generated tokens, the prompt tokens whose KV came from the prefix cache)."""
    before = engine.stats().prefix_tokens_reused
    tokens: list[int] = []
    stream = await engine.submit(request)
    async with asyncio.timeout(60):
        async for event in stream:
            if isinstance(event, TokenChunk):
                tokens.extend(event.token_ids)
            assert not isinstance(event, GenerationEnd) or event.finish_reason.value in ("stop", "length")
    return tokens, engine.stats().prefix_tokens_reused - before


async def test_a_second_request_with_the_same_prefix_reuses_its_pages_and_answers_the_same(
    engine: TransformersEngine, engine_without_reuse: TransformersEngine
) -> None:
    start = engine.stats()
    first, reused_first = await greedy(engine, chat("first", SYSTEM, "Where is the arm?"))
    second, reused_second = await greedy(engine, chat("second", SYSTEM, "Is the fence closed?"))
    other, reused_other = await greedy(engine, chat("other", OTHER_SYSTEM, "Is the fence closed?"))

    assert reused_first == 0 and reused_other == 0  # nothing to reuse yet / a different prefix
    assert reused_second >= 6 * 64, reused_second  # the system prompt's full pages (~500 tokens)
    assert reused_second % 64 == 0  # page granularity
    end = engine.stats()
    assert end.prefix_lookups - start.prefix_lookups == 3
    assert end.prefix_hits - start.prefix_hits == 1
    assert end.prefix_blocks_cached > 0  # the finished requests' pages wait for the next one

    # the reused KV gives exactly the tokens a full prefill gives
    assert (await greedy(engine_without_reuse, chat("second", SYSTEM, "Is the fence closed?")))[0] == second
    assert (await greedy(engine_without_reuse, chat("first", SYSTEM, "Where is the arm?")))[0] == first
    assert engine_without_reuse.stats().prefix_tokens_reused == 0
    assert other != second or first != second  # the random model does answer differently


async def test_a_budget_keeps_the_cached_pages_under_it(chat_repo: Path) -> None:
    folder = chat_repo / "tiny-chat-budget"
    folder.mkdir()
    config = (chat_repo / MODEL / "config.yaml").read_text()
    (folder / "config.yaml").write_text(config + "prefix_cache_max_blocks: 4\n")
    shutil.copytree(chat_repo / MODEL / "artifacts", folder / "artifacts")
    for budgeted in _engine(chat_repo, "tiny-chat-budget"):
        await greedy(budgeted, chat("a", SYSTEM, "one?"))
        stats = budgeted.stats()
        assert stats.prefix_blocks_cached == 4
        assert stats.prefix_blocks_evicted >= 3  # ~8 pages were cached: the tail ones went
        # the head pages stayed: the same prompt still reuses its first 4 pages
        _, reused = await greedy(budgeted, chat("b", SYSTEM, "two?"))
        assert reused == 4 * 64


async def test_the_worker_reports_prefix_hits_and_reused_tokens(
    chat_repo: Path, start_worker: Any, leases: Any
) -> None:
    async with start_worker(chat_repo, preload=[MODEL], lease_client=leases) as worker:
        recorded: list[tuple[str, float, dict[str, str]]] = []
        real_record = worker.telemetry.record

        def record(name: str, value: float, labels: Any = None) -> None:
            recorded.append((name, value, dict(labels or {})))
            real_record(name, value, labels)

        worker.telemetry.record = record  # type: ignore[method-assign]
        context = zmq.asyncio.Context()
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(worker.data_endpoint)
        try:
            for request_id, question in (("w1", "Where is the arm?"), ("w2", "Is the fence closed?")):
                message = model_pool_pb2.GenerateRequest(
                    request_id=request_id,
                    model_id=MODEL,
                    sampling=model_pool_pb2.SamplingParams(max_tokens=4, temperature=0.0),
                )
                message.messages.messages.extend(
                    [
                        model_pool_pb2.ChatMessage(role="system", content=SYSTEM),
                        model_pool_pb2.ChatMessage(role="user", content=question),
                    ]
                )
                await socket.send_multipart([GENERATE_REQUEST_FRAME, message.SerializeToString()])
                order = StreamOrder()
                async with asyncio.timeout(60):
                    while not order.finished:
                        frames = await socket.recv_multipart()
                        assert frames[0] == GENERATE_REPLIES_FRAME
                        for reply in model_pool_pb2.GenerateReplies.FromString(frames[1]).replies:
                            order.accept(reply)
                            assert not reply.HasField("error"), reply
        finally:
            socket.close()
            context.term()

    def total(name: str) -> float:
        return sum(value for n, value, labels in recorded if n == name and labels.get("model") == MODEL)

    assert total("prefix_cache_queries") >= 2  # and the warm-up's one-token prompt
    assert total("prefix_cache_hits") == 1
    assert total("prefix_cache_reused_tokens") >= 6 * 64
