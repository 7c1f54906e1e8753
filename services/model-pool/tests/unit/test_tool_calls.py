"""Tool calls read out of a model's text (tool_calls.py): the three formats, fed whole and in
every split, calls that stay text when they are not calls, and the stream wrapper."""

from __future__ import annotations

import json
import random

import pytest

from loadmaster.model_pool.generation import (
    ChoiceEnd,
    FinishReason,
    GenerationEnd,
    GenerationEvent,
    TokenChunk,
    Usage,
)
from loadmaster.model_pool.tool_calls import ToolCallParser, ToolCallStream, ToolFormat

NAMES = ("get_weather", "add")
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'


def parse(
    format: ToolFormat, text: str, *, pieces: list[str] | None = None, parallel: bool = True
) -> tuple[str, list[tuple[str, dict]]]:
    parser = ToolCallParser(format, NAMES, parallel=parallel)
    content = []
    calls = []
    for piece in pieces if pieces is not None else [text]:
        out, new = parser.feed(piece)
        content.append(out)
        calls.extend(new)
    out, new = parser.finish()
    content.append(out)
    calls.extend(new)
    assert [call.index for call in calls] == list(range(len(calls)))
    assert all(call.id.startswith("call_") and len(call.id) == 29 for call in calls)
    assert len({call.id for call in calls}) == len(calls)
    return "".join(content), [(call.name, json.loads(call.arguments)) for call in calls]


def splits(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


HERMES_CASES = [
    ("just text", "just text", []),
    (f"<tool_call>\n{WEATHER}\n</tool_call>", "", [("get_weather", {"city": "Paris", "days": 2})]),
    (
        f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
        '{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>',
        "Let me look.",
        [("get_weather", {"city": "Paris", "days": 2}), ("add", {"a": 1, "b": 2})],
    ),
    # not calls: broken JSON, an unknown function, arguments that are no object: text, unchanged
    ("<tool_call>\n{broken\n</tool_call>", "<tool_call>\n{broken\n</tool_call>", []),
    (
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> ok',
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> ok',
        [],
    ),
    (
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
        [],
    ),
    # an unclosed call at the end: its complete JSON still counts; an incomplete one is text
    (f"<tool_call>\n{WEATHER}\n", "", [("get_weather", {"city": "Paris", "days": 2})]),
    ('<tool_call>\n{"name": "get_wea', '<tool_call>\n{"name": "get_wea', []),
    ("a < b and <tool_ca", "a < b and <tool_ca", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_calls_whole_and_in_every_split(
    text: str, content: str, calls: list[tuple[str, dict]]
) -> None:
    assert parse(ToolFormat.HERMES, text) == (content, calls)
    for seed in range(20):
        assert parse(ToolFormat.HERMES, text, pieces=splits(text, seed)) == (content, calls)


def test_hermes_streams_text_before_a_call_and_holds_only_a_possible_marker() -> None:
    parser = ToolCallParser(ToolFormat.HERMES, NAMES)
    assert parser.feed("Sure, checking") == ("Sure, checking", [])
    assert parser.feed(" now <tool") == (" now", [])  # "<tool" may open a call; the space waits
    text, calls = parser.feed(f"_call>{WEATHER}</tool_call>")
    assert text == "" and [c.name for c in calls] == ["get_weather"]
    assert parser.finish() == ("", [])


def test_without_parallel_calls_the_first_call_is_the_reply() -> None:
    text = (
        f"<tool_call>{WEATHER}</tool_call> and <tool_call>"
        + '{"name": "add", "arguments": {}}</tool_call> bye'
    )
    assert parse(ToolFormat.HERMES, text, parallel=False) == (
        "",
        [("get_weather", {"city": "Paris", "days": 2})],
    )


LLAMA_CASES = [
    ('{"name": "add", "parameters": {"a": 1}}', "", [("add", {"a": 1})]),
    (
        '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {}}',
        "",
        [("add", {"a": 1}), ("get_weather", {})],
    ),
    ('  {"name": "add", "arguments": {"a": 1}}', "", [("add", {"a": 1})]),
    ("The answer is 3.", "The answer is 3.", []),
    ('{"not": "a call"}', '{"not": "a call"}', []),
    (
        '{"name": "add", "parameters": {"a": 1}} trailing',
        '{"name": "add", "parameters": {"a": 1}} trailing',
        [],
    ),
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA_CASES)
def test_llama_json_calls(text: str, content: str, calls: list[tuple[str, dict]]) -> None:
    assert parse(ToolFormat.LLAMA, text) == (content, calls)
    for seed in range(10):
        assert parse(ToolFormat.LLAMA, text, pieces=splits(text, seed)) == (content, calls)


MISTRAL_CASES = [
    (
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {"city": "x"}}]',
        "",
        [("add", {"a": 1}), ("get_weather", {"city": "x"})],
    ),
    ('[{"name": "add", "arguments": {"a": 2}}]', "", [("add", {"a": 2})]),  # the marker was a special token
    ("[1, 2] is a list", "[1, 2] is a list", []),
    ("Plain [text]", "Plain [text]", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), MISTRAL_CASES)
def test_mistral_json_calls(text: str, content: str, calls: list[tuple[str, dict]]) -> None:
    assert parse(ToolFormat.MISTRAL, text) == (content, calls)
    for seed in range(10):
        assert parse(ToolFormat.MISTRAL, text, pieces=splits(text, seed)) == (content, calls)


def test_a_text_reply_streams_at_once_in_the_whole_reply_formats() -> None:
    parser = ToolCallParser(ToolFormat.LLAMA, NAMES)
    assert parser.feed("Hello") == ("Hello", [])
    parser = ToolCallParser(ToolFormat.MISTRAL, NAMES)
    assert parser.feed("[TOOL") == ("", [])  # maybe the marker
    assert parser.feed("_CALLS][]") == ("", [])


class _Scripted:
    """A finished engine stream: its events, all ready."""

    def __init__(self, events: list[GenerationEvent]) -> None:
        self._events = list(events)
        self.closed = False

    def __aiter__(self) -> _Scripted:
        return self

    async def __anext__(self) -> GenerationEvent:
        if not self._events:
            raise StopAsyncIteration
        return self._events.pop(0)

    def ready(self) -> list[GenerationEvent]:
        out, self._events = self._events, []
        return out

    async def aclose(self) -> None:
        self.closed = True


async def test_the_stream_wrapper_keeps_tokens_renumbers_and_ends_with_tool_calls() -> None:
    text = f"Hi <tool_call>{WEATHER}</tool_call>"
    pieces = [text[:5], text[5:30], text[30:]]
    events: list[GenerationEvent] = [  # two choices, interleaved
        TokenChunk("r", 2 * i + choice, (i,), piece, choice=choice)
        for i, piece in enumerate(pieces)
        for choice in (0, 1)
    ]
    usage = Usage(3, 6)
    events.append(
        GenerationEnd(
            "r",
            6,
            FinishReason.STOP,
            usage,
            choices=(ChoiceEnd(0, FinishReason.STOP, 3), ChoiceEnd(1, FinishReason.LENGTH, 3)),
        )
    )
    stream = ToolCallStream(_Scripted(events), format=ToolFormat.HERMES, names=NAMES)
    out: list[GenerationEvent] = []
    async for first in stream:
        out.extend([first, *stream.ready()])
    assert [event.sequence for event in out] == list(range(len(out)))
    chunks = [e for e in out if isinstance(e, TokenChunk)]
    assert sum(len(c.token_ids) for c in chunks) == 6
    for choice in (0, 1):
        mine = [c for c in chunks if c.choice == choice]
        assert "".join(c.text for c in mine) == "Hi"
        assert [call.name for c in mine for call in c.tool_calls] == ["get_weather"]
    end = out[-1]
    assert isinstance(end, GenerationEnd)
    assert [c.finish_reason for c in end.choices] == [FinishReason.TOOL_CALLS, FinishReason.LENGTH]
