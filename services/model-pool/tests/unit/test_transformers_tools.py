"""Tools through tiny-chat's chat template (examples/make_models.py): offered tools, earlier
calls and `tool` turns render; a template without tool support is a 400 naming `tools`; a
chat without tools renders as it did before tools existed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.model_pool.engines import EngineContext
from loadmaster.model_pool.engines.transformers import TransformersEngine
from loadmaster.model_pool.generation import (
    ChatMessage,
    FinishReason,
    FunctionTool,
    GenerationEnd,
    GenerationRequest,
    SamplingParams,
    TokenChunk,
    ToolCall,
    ToolChoice,
    ToolUse,
)
from loadmaster.model_pool.repository import ModelRepository

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
WEATHER = FunctionTool(
    "get_weather",
    "the weather in a city",
    json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
)
HISTORY = (
    ChatMessage("system", "be brief"),
    ChatMessage("user", "weather in Oslo?"),
    ChatMessage("assistant", "", tool_calls=(ToolCall("call_1", "get_weather", '{"city":"Oslo"}'),)),
    ChatMessage("tool", "rain, 4 C", tool_call_id="call_1", name="get_weather"),
)
# tiny-chat's template before tools (what a model without tool support has)
NO_TOOLS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] "
    "+ eos_token }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@pytest.fixture(scope="module")
def engine() -> Iterator[TransformersEngine]:
    instance = TransformersEngine(
        ModelRepository(EXAMPLES / "models").spec("tiny-chat"), EngineContext(device="cpu", threads=1)
    )
    instance.load()
    yield instance
    instance.unload()


def chat(messages: tuple[ChatMessage, ...], tools: ToolUse | None = None) -> GenerationRequest:
    return GenerationRequest(
        "t", SamplingParams(max_tokens=8, temperature=0.0), messages=messages, tools=tools
    )


def rendered(engine: TransformersEngine, request: GenerationRequest) -> str:
    return str(engine._tokenizer.decode(engine._prompt_ids(request)))


def test_tools_calls_and_tool_turns_render_through_the_template(engine: TransformersEngine) -> None:
    text = rendered(engine, chat(HISTORY, ToolUse((WEATHER,))))
    assert text.startswith("<s><|system|>be brief\n\nYou may call one or more functions")
    assert '"name": "get_weather"' in text and '"description": "the weather in a city"' in text
    assert (
        '<|assistant|><tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call></s>'
        in text
    )
    assert text.endswith("<|tool|><tool_response>\nrain, 4 C\n</tool_response></s><|assistant|>")
    plain = rendered(engine, chat((ChatMessage("system", "be brief"), ChatMessage("user", "hi"))))
    assert plain == "<s><|system|>be brief</s><|user|>hi</s><|assistant|>"  # as before tools


def test_a_template_without_tool_support_is_a_400_naming_tools(engine: TransformersEngine) -> None:
    tokenizer = engine._tokenizer
    full, tokenizer.chat_template = tokenizer.chat_template, NO_TOOLS_TEMPLATE
    try:
        with pytest.raises(InvalidArgumentError, match=r"^tools: the chat template of model 'tiny-chat'"):
            engine._prompt_ids(chat(HISTORY[:2], ToolUse((WEATHER,))))
        engine._prompt_ids(chat(HISTORY[:2]))  # without tools it still chats
    finally:
        tokenizer.chat_template = full


async def test_an_auto_reply_of_a_random_model_is_text(engine: TransformersEngine) -> None:
    """tiny-chat's random weights never write `<tool_call>`: an auto reply is its text."""
    request = chat(HISTORY[:2], ToolUse((WEATHER,), choice=ToolChoice.AUTO))
    text: list[str] = []
    async with asyncio.timeout(30):
        async for event in await engine.submit(request):
            if isinstance(event, TokenChunk):
                assert not event.tool_calls
                text.append(event.text)
            else:
                end = event
    assert isinstance(end, GenerationEnd) and end.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert end.usage.completion_tokens == 8 or end.finish_reason is FinishReason.STOP
    assert "".join(text)
