"""The official `openai` client against the real suite: tool calls (a named function and
`required` from tiny-chat, constrained while decoding; `auto` read out of the scripted
replay-chat's text, streamed and not), a tool turn in the history, log probabilities, n=2,
and the 400s for what a model or this server cannot honour.

tiny-chat and replay-chat are not preloaded: the first test that uses each pays for its load."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from loadmaster.cli.launcher import Suite

CHAT = "tiny-chat"
REPLAY = "replay-chat"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER_PARAMETERS},
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -99, "maximum": 99},
                    "b": {"type": "integer", "minimum": -99, "maximum": 99},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
HERMES_REPLY = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n<tool_call>\n'
    '{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def client(suite: Suite) -> Iterator[openai.OpenAI]:
    gateway = suite.settings.gateway
    url = f"http://{gateway.http_host}:{gateway.http_port}/v1"
    with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120) as client:
        yield client


def user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def test_a_named_tool_choice_is_a_call_of_that_function_with_valid_arguments(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=CHAT,
        messages=user("weather in Oslo?"),
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0.7,
        seed=5,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER_PARAMETERS)


def test_required_tool_calls_stream_as_tool_call_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=CHAT,
        messages=user("do something"),
        tools=TOOLS,
        tool_choice="required",
        max_tokens=1024,  # parallel calls: at most 8 (engines/tool_grammar.py)
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    finishes = []
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert finishes == ["tool_calls"] and calls
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_auto_tool_calls_are_read_out_of_the_models_text(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=REPLAY, messages=user(HERMES_REPLY), tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}),
        ("add", {"a": 1, "b": 2}),
    ]
    assert len({c.id for c in calls}) == 2
    # no tools offered: the same text is the reply's content
    plain = client.chat.completions.create(model=REPLAY, messages=user(HERMES_REPLY))
    assert plain.choices[0].message.content == HERMES_REPLY and plain.choices[0].finish_reason == "stop"


def test_auto_tool_calls_stream_as_deltas_after_the_text(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=REPLAY,
        messages=user(HERMES_REPLY),
        tools=TOOLS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert text == "Let me check."
    assert [(d.index, d.function.name if d.function else None) for d in deltas] == [
        (0, "get_weather"),
        (1, "add"),
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"
    ]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 10


def test_a_tool_turn_in_the_history_renders_and_the_chat_goes_on(client: openai.OpenAI) -> None:
    messages: list[Any] = [
        *user("weather in Oslo?"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rain, 4 C"},
    ]
    with_tools = client.chat.completions.create(model=CHAT, messages=messages, tools=TOOLS, max_tokens=4)
    without = client.chat.completions.create(model=CHAT, messages=messages, max_tokens=4)
    assert with_tools.usage is not None and without.usage is not None
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 50  # the tools are in the prompt
    assert with_tools.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_what_cannot_be_honoured_is_a_400_naming_the_field(client: openai.OpenAI) -> None:
    for kwargs, param in (
        ({"model": REPLAY, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        ({"model": REPLAY, "logprobs": True}, "logprobs"),
        ({"model": CHAT, "frequency_penalty": 0.5}, "frequency_penalty"),
        ({"model": CHAT, "logit_bias": {"5": 10}}, "logit_bias"),
        ({"model": CHAT, "n": 9}, "n"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(messages=user("hi"), max_tokens=4, **kwargs)  # type: ignore[call-overload]
        message = caught.value.body["message"] if isinstance(caught.value.body, dict) else str(caught.value)
        assert param in message, (param, message)


def test_logprobs_come_per_token_from_the_sampled_distribution(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=CHAT, messages=user("hello"), max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content if reply.choices[0].logprobs else None
    assert content is not None and len(content) == 6
    whole = b"".join(bytes(item.bytes or []) for item in content)
    assert whole.decode(errors="replace") == reply.choices[0].message.content
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob >= item.top_logprobs[2].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy: the most likely
        assert bytes(item.bytes or []).decode(errors="replace") == item.token
    stream = client.chat.completions.create(
        model=CHAT, messages=user("hello"), max_tokens=6, temperature=0, logprobs=True, stream=True
    )
    streamed = [
        item
        for c in stream
        if c.choices and c.choices[0].logprobs
        for item in c.choices[0].logprobs.content or []
    ]
    assert [(i.token, round(i.logprob, 4)) for i in streamed] == [
        (i.token, round(i.logprob, 4)) for i in content
    ]
    text = client.completions.create(model=CHAT, prompt="hello", max_tokens=5, temperature=0, logprobs=2)
    assert text.choices[0].logprobs is not None and len(text.choices[0].logprobs.tokens or []) == 5


def test_n_2_gives_two_choices_from_one_prompt(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=CHAT, messages=user("hello"), max_tokens=12, temperature=1.0, seed=3, n=2
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].message.content != reply.choices[1].message.content  # own seeds
    assert reply.usage is not None and reply.usage.completion_tokens <= 24
    single = client.chat.completions.create(
        model=CHAT, messages=user("hello"), max_tokens=12, temperature=1.0, seed=3
    )
    assert single.choices[0].message.content == reply.choices[0].message.content  # choice 0 is n=1's
    stream = client.chat.completions.create(
        model=CHAT, messages=user("hello"), max_tokens=12, temperature=1.0, seed=3, n=2, stream=True
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in reply.choices]
