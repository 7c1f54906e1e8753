"""The OpenAI API's shapes: bodies parse into GenerationRequests or name the bad field, and what
we build validates as the official `openai` package's own types."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from loadmaster.common.errors import InvalidArgumentError, NotFoundError, UnavailableError
from loadmaster.gateway.frontends.openai_schema import (
    DONE_EVENT,
    ChoiceOut,
    OpenAIError,
    Usage,
    chat_chunk,
    chat_completion,
    completion,
    completion_chunk,
    error_from,
    event,
    parse_chat,
    parse_completion,
)
from loadmaster.gateway.generation import MAX_CONTENT_PARTS
from loadmaster.gateway.generation_items import ChatTurn, FunctionSpec, TokenLogprob, ToolCall, TopLogprob

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def body(**fields: object) -> bytes:
    return json.dumps(
        {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], **fields}
    ).encode()


def test_a_chat_body_becomes_a_generation_request_without_extensions_or_unknown_fields() -> None:
    request = parse_chat(
        body(
            messages=[
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}],
                },
            ],
            max_completion_tokens=16,
            max_tokens=99,
            temperature=0.5,
            top_p=0.9,
            seed=7,
            stop="\n",
            n=1,
            stream=True,
            stream_options={"include_usage": True},
            x_client_id="arm-1",
            x_priority=0,
            x_urgency=0.8,
            x_deadline_ms=250,
            metadata={"k": "v"},  # unknown to us: ignored, as OpenAI's server does
            frequency_penalty=0,  # known, at its neutral value: accepted
            logit_bias={},
        )
    )
    assert request.messages == (ChatTurn("system", "be brief"), ChatTurn("user", "hello"))
    assert (request.tools, request.logprobs, request.n) == (None, None, 1)
    assert request.max_tokens == 16  # max_completion_tokens wins over the legacy max_tokens
    assert (request.temperature, request.top_p, request.seed, request.stop) == (0.5, 0.9, 7, ("\n",))
    assert request.stream and request.include_usage
    assert (request.client_id, request.priority, request.urgency, request.deadline_ms) == (
        "arm-1",
        0,
        0.8,
        250,
    )


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"messages": []}, "messages", "at least one message"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "role"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"temperature": 3}, "temperature", "less than or equal to 2"),
        ({"n": 9}, "n", "limit of 8"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"logit_bias": {"1": 2}}, "logit_bias", "not supported by this server"),
        ({"frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
        ({"presence_penalty": -1}, "presence_penalty", "not supported"),
        ({"store": True}, "store", "not supported"),
        ({"modalities": ["text", "audio"]}, "modalities", "not supported"),
        ({"functions": [{"name": "f"}]}, "functions", "not supported"),
        ({"top_logprobs": 2}, "top_logprobs", "requires logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        ({"tool_choice": "required"}, "tool_choice", "only allowed when tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools.0.function.name",
            "should match pattern",
        ),
        (
            {"tools": [TOOL, TOOL]},
            "tools",
            "given twice",
        ),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope' is not one of the tools",
        ),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"x_priority": -1}, "x_priority", "greater than or equal to 0"),
        # Bounds on the counts that hold the event loop while a body parses (MAX_MESSAGES, …).
        ({"messages": [{"role": "user", "content": "x"}] * 2049}, "messages", "at most 2048 items"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 257}]},
            "messages.0.content",
            "257 parts exceed this server's limit of 256",
        ),
        (
            {"chat_template_kwargs": {"messages": []}},
            "chat_template_kwargs",
            "'messages' is set by the server",
        ),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "valid dictionary"),
        ({"response_format": {"type": "yaml"}}, "response_format", "'yaml' is not one of"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema: an object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
            "response_format",
            "json_schema.schema: a JSON Schema",
        ),
    ],
)
def test_bad_chat_bodies_are_400s_naming_the_field(fields: dict[str, object], param: str, words: str) -> None:
    with pytest.raises(OpenAIError) as caught:
        parse_chat(body(**fields))
    assert (caught.value.status, caught.value.param) == (400, param)
    assert words in caught.value.message
    assert caught.value.body()["error"]["type"] == "invalid_request_error"


def test_the_part_limit_bounds_lists_of_parts_not_the_characters_of_a_string() -> None:
    long = "word " * (4 * MAX_CONTENT_PARTS)
    request = parse_chat(body(messages=[{"role": "user", "content": long}]))
    assert request.messages is not None and [turn.content for turn in request.messages] == [long]


def test_the_model_may_be_left_to_a_profile_and_template_kwargs_reach_the_request() -> None:
    request = parse_chat(body(model="", chat_template_kwargs={"enable_thinking": False}))
    assert request.model == ""  # the front end refuses it unless the client's profile names one
    assert request.chat_template_kwargs == {"enable_thinking": False}
    assert parse_chat(body()).chat_template_kwargs is None
    with pytest.raises(OpenAIError, match="only chat completions render a chat template") as caught:
        parse_completion(b'{"model": "m", "prompt": "x", "chat_template_kwargs": {"a": 1}}')
    assert caught.value.param == "chat_template_kwargs"


def test_missing_fields_and_broken_json_are_400s() -> None:
    with pytest.raises(OpenAIError, match="'messages' is a required property") as caught:
        parse_chat(b'{"model": "m"}')
    assert caught.value.param == "messages"
    with pytest.raises(OpenAIError, match="not valid JSON"):
        parse_chat(b'{"model": ')


def test_a_completion_body_takes_one_prompt() -> None:
    assert parse_completion(b'{"model": "m", "prompt": ["once"]}').prompt == "once"
    assert parse_completion(b'{"model": "m", "prompt": "twice"}').messages is None
    with pytest.raises(OpenAIError, match="exactly one prompt"):
        parse_completion(b'{"model": "m", "prompt": ["a", "b"]}')


def test_replies_validate_as_the_openai_clients_types() -> None:
    usage = Usage(prompt_tokens=5, completion_tokens=3)
    chat = ChatCompletion.model_validate(
        chat_completion(
            request_id="chatcmpl-1", model="tiny-chat", text="abc", finish_reason="stop", usage=usage
        )
    )
    assert chat.choices[0].message.content == "abc"
    assert chat.usage is not None and chat.usage.total_tokens == 8
    first = ChatCompletionChunk.model_validate(
        chat_chunk(request_id="c", model="m", created=1, text="a", role=True)
    )
    assert (first.choices[0].delta.role, first.choices[0].delta.content) == ("assistant", "a")
    last = ChatCompletionChunk.model_validate(
        chat_chunk(request_id="c", model="m", created=1, finish_reason="length")
    )
    assert last.choices[0].finish_reason == "length"
    tally = ChatCompletionChunk.model_validate(chat_chunk(request_id="c", model="m", created=1, usage=usage))
    assert tally.choices == [] and tally.usage is not None and tally.usage.completion_tokens == 3
    text = Completion.model_validate(
        completion(request_id="cmpl-1", model="m", text="xyz", finish_reason="length", usage=usage)
    )
    assert text.choices[0].text == "xyz"
    # The client reads stream chunks without validating them (OpenAI sends finish_reason null until
    # the last one, which its `Completion` type does not allow): the last chunk validates.
    final = Completion.model_validate(
        completion_chunk(request_id="c", model="m", created=1, finish_reason="stop")
    )
    assert final.choices[0].finish_reason == "stop"
    assert completion_chunk(request_id="c", model="m", created=1, text="x")["choices"][0]["text"] == "x"


def test_events_are_server_sent_json_and_errors_keep_openais_shape() -> None:
    raw = event({"a": 1})
    assert raw == b'data: {"a":1}\n\n' and DONE_EVENT == b"data: [DONE]\n\n"
    with pytest.raises(ValueError):
        event({"a": float("nan")})  # never a bare NaN on the wire
    missing = error_from(NotFoundError("model 'nope' is not served")).body()["error"]
    assert missing == {
        "message": "model 'nope' is not served",
        "type": "not_found_error",
        "param": None,
        "code": "not_found",
    }
    assert error_from(UnavailableError("no worker")).status == 503


def test_tools_tool_history_logprobs_and_n_become_the_requests_fields() -> None:
    request = parse_chat(
        body(
            messages=[
                {"role": "user", "content": "weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
            ],
            tools=[TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False,
            logprobs=True,
            top_logprobs=3,
            n=2,
        )
    )
    assert request.messages is not None
    assert request.messages[1] == ChatTurn(
        "assistant", "", tool_calls=(ToolCall("call_1", "get_weather", '{"city":"Paris"}'),)
    )
    assert request.messages[2] == ChatTurn("tool", "sunny", tool_call_id="call_1", name="get_weather")
    assert request.tools is not None
    assert request.tools.functions == (
        FunctionSpec("get_weather", "the weather in a city", TOOL["function"]["parameters"]),  # type: ignore[index]
    )
    assert (request.tools.choice, request.tools.function_name, request.tools.parallel) == (
        "function",
        "get_weather",
        False,
    )
    assert (request.logprobs, request.n) == (3, 2)
    auto = parse_chat(body(tools=[TOOL]))
    assert auto.tools is not None and (auto.tools.choice, auto.tools.parallel) == ("auto", True)
    assert parse_chat(body(logprobs=True)).logprobs == 0  # the sampled token's only
    assert parse_chat(body(logprobs=False, top_logprobs=None)).logprobs is None
    assert parse_chat(body(n=4), max_n=4).n == 4
    with pytest.raises(OpenAIError, match="limit of 3"):
        parse_chat(body(n=4), max_n=3)


def test_completion_bodies_take_logprobs_0_to_5_and_refuse_echo_and_best_of() -> None:
    assert parse_completion(b'{"model": "m", "prompt": "x", "logprobs": 2, "n": 2}').logprobs == 2
    for raw, param in (
        (b'{"model": "m", "prompt": "x", "logprobs": 6}', "logprobs"),
        (b'{"model": "m", "prompt": "x", "echo": true}', "echo"),
        (b'{"model": "m", "prompt": "x", "best_of": 3}', "best_of"),
        (b'{"model": "m", "prompt": "x", "suffix": "end"}', "suffix"),
    ):
        with pytest.raises(OpenAIError) as caught:
            parse_completion(raw)
        assert (caught.value.status, caught.value.param) == (400, param)


def test_tool_calls_logprobs_and_choices_validate_as_the_openai_clients_types() -> None:
    usage = Usage(prompt_tokens=5, completion_tokens=3)
    call = ToolCall("call_a", "get_weather", '{"city":"Oslo"}', index=0)
    top = (TopLogprob("a", b"a", -0.1), TopLogprob("b", b"b", float("-inf")))
    logprobs = [TokenLogprob("a", b"a", -0.1, top)]
    reply = ChatCompletion.model_validate(
        chat_completion(
            request_id="chatcmpl-2",
            model="m",
            usage=usage,
            choices=[
                ChoiceOut(0, "", "tool_calls", tool_calls=[call], logprobs=logprobs),
                ChoiceOut(1, "text", "stop"),
            ],
        )
    )
    first, second = reply.choices
    assert first.message.content is None and first.finish_reason == "tool_calls"
    assert first.message.tool_calls is not None
    assert first.message.tool_calls[0].function.arguments == '{"city":"Oslo"}'
    assert first.logprobs is not None and first.logprobs.content is not None
    assert first.logprobs.content[0].top_logprobs[1].logprob == -9999.0  # never -inf in JSON
    assert (second.index, second.message.content, second.logprobs) == (1, "text", None)
    delta = ChatCompletionChunk.model_validate(
        chat_chunk(
            request_id="c", model="m", created=1, index=1, tool_calls=(call,), logprobs=tuple(logprobs)
        )
    )
    assert delta.choices[0].index == 1 and delta.choices[0].delta.tool_calls is not None
    assert delta.choices[0].delta.tool_calls[0].index == 0
    assert delta.choices[0].logprobs is not None
    text = Completion.model_validate(
        completion(
            request_id="c", model="m", usage=usage, choices=[ChoiceOut(0, "ab", "length", logprobs=logprobs)]
        )
    )
    assert text.choices[0].logprobs is not None and text.choices[0].logprobs.top_logprobs == [
        {"a": -0.1, "b": -9999.0}
    ]


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ("max_tokens: 4 is too small for a reply valid against response_format", "max_tokens"),
        ("response_format.json_schema.schema: cannot be compiled: x", "response_format.json_schema.schema"),
        ("prompt of 9 tokens + max_tokens 5000 exceeds the context", None),
        ("model 'x' has no chat template: send a prompt", None),
    ],
)
def test_a_worker_400_that_starts_with_a_field_names_it_as_param(message: str, param: str | None) -> None:
    """Workers write invalid-argument messages as `field: why`; OpenAI's clients read the
    field from `param`."""
    body = error_from(InvalidArgumentError(message)).body()["error"]
    assert (body["param"], body["message"], body["type"]) == (param, message, "invalid_request_error")
    assert error_from(UnavailableError("max_tokens: not a 400")).param is None
