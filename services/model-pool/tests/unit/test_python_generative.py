"""The Python generative engine with the example `replay-chat` model: pieces, stop strings,
max_tokens, cancel, tool calls read out of its text, and the fields it refuses by name."""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
from pathlib import Path

import pytest

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.model_pool.engines import EngineContext, engine_class
from loadmaster.model_pool.engines.python_generative import PythonGenerativeEngine
from loadmaster.model_pool.generation import (
    ChatMessage,
    FinishReason,
    FunctionTool,
    GenerationEnd,
    GenerationRequest,
    SamplingParams,
    TokenChunk,
    ToolChoice,
    ToolUse,
)
from loadmaster.model_pool.repository import ModelRepository

EXAMPLES = Path(__file__).resolve().parents[4] / "examples" / "models"
WEATHER = FunctionTool(
    "get_weather", "", json.dumps({"type": "object", "properties": {"city": {"type": "string"}}})
)


@pytest.fixture()
def engine(tmp_path: Path) -> PythonGenerativeEngine:
    shutil.copytree(EXAMPLES / "replay-chat", tmp_path / "replay-chat")
    spec = ModelRepository(tmp_path).spec("replay-chat")
    cls = engine_class(spec.backend)
    assert cls is PythonGenerativeEngine
    instance = PythonGenerativeEngine(spec, EngineContext(device="cpu"))
    instance.load()
    return instance


_IDS = itertools.count()


def chat(
    text: str, *, request_id: str = "", tools: ToolUse | None = None, **params: object
) -> GenerationRequest:
    """A chat request; its id is new each time unless given (an id is taken until the engine
    has forgotten its stream, which may be a moment after its last event)."""
    params.setdefault("max_tokens", 100)
    return GenerationRequest(
        request_id or f"r{next(_IDS)}",
        SamplingParams(**params),
        messages=(ChatMessage("user", text),),
        tools=tools,  # type: ignore[arg-type]
    )


async def run(
    engine: PythonGenerativeEngine, request: GenerationRequest
) -> tuple[list[TokenChunk], GenerationEnd]:
    chunks: list[TokenChunk] = []
    async with asyncio.timeout(10):
        stream = await engine.submit(request)
        async for event in stream:
            if isinstance(event, GenerationEnd):
                return chunks, event
            chunks.append(event)
    raise AssertionError("no terminal")


async def test_it_replays_the_text_in_pieces_with_stop_strings_and_max_tokens(
    engine: PythonGenerativeEngine,
) -> None:
    chunks, end = await run(engine, chat("hello world"))
    assert [c.text for c in chunks] == ["hel", "lo ", "wor", "ld"]
    assert [c.sequence for c in chunks] == [0, 1, 2, 3] and end.sequence == 4
    assert end.finish_reason is FinishReason.STOP and end.usage.completion_tokens == 4
    chunks, end = await run(engine, chat("hello world", stop=("o w",)))
    assert "".join(c.text for c in chunks) == "hell" and end.finish_reason is FinishReason.STOP
    chunks, end = await run(engine, chat("hello world", max_tokens=2))
    assert "".join(c.text for c in chunks) == "hello " and end.finish_reason is FinishReason.LENGTH


async def test_a_hermes_tool_call_in_its_text_becomes_a_call(engine: PythonGenerativeEngine) -> None:
    tools = ToolUse((WEATHER,))
    text = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    chunks, end = await run(engine, chat(text, tools=tools))
    assert "".join(c.text for c in chunks) == "Checking."
    calls = [call for c in chunks for call in c.tool_calls]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert end.finish_reason is FinishReason.TOOL_CALLS
    # tool_choice none: the same text is text
    chunks, end = await run(engine, chat(text, tools=ToolUse((WEATHER,), choice=ToolChoice.NONE)))
    assert "".join(c.text for c in chunks) == text and end.finish_reason is FinishReason.STOP


async def test_what_a_python_model_cannot_honour_is_refused_by_name(engine: PythonGenerativeEngine) -> None:
    forced = ToolUse((WEATHER,), choice=ToolChoice.REQUIRED)
    for request, field in (
        (chat("x", tools=forced), "tool_choice"),
        (GenerationRequest("r", SamplingParams(max_tokens=4), prompt="x", logprobs=2), "logprobs"),
        (GenerationRequest("r", SamplingParams(max_tokens=4), prompt="x", n=2), "n"),
    ):
        with pytest.raises(InvalidArgumentError, match=f"^{field}:"):
            await engine.submit(request)


SLOW = """
import time

class Slow:
    def generate(self, request):
        for _ in range(1000):
            time.sleep(0.01)
            yield "x"
"""


async def test_cancel_ends_the_stream_with_cancelled_between_pieces(tmp_path: Path) -> None:
    folder = tmp_path / "slow"
    folder.mkdir()
    (folder / "model.py").write_text(SLOW)
    (folder / "config.yaml").write_text("backend: python_generative\nclass: Slow\n")
    slow = PythonGenerativeEngine(ModelRepository(tmp_path).spec("slow"), EngineContext(device="cpu"))
    slow.load()
    stream = await slow.submit(chat("", request_id="r", max_tokens=2000))
    assert isinstance(await anext(stream), TokenChunk)
    assert slow.cancel("r") and not slow.cancel("unknown")
    async with asyncio.timeout(2):  # 1000 pieces would take 10 s
        events = [event async for event in stream]
    end = events[-1]
    assert isinstance(end, GenerationEnd) and end.finish_reason is FinishReason.CANCELLED
    assert end.usage.completion_tokens < 50
