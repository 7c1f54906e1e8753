"""The Anthropic Messages routes, driven in-process (ASGI, no sockets) by the official `anthropic`
client, over a recording stand-in for the rest of the gateway (this module's one collaborator):
what each body becomes on the OpenAI plane, the replies and the stream's event order, and
each 400 with its message."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
from starlette.applications import Starlette

from loadmaster.common.errors import NotFoundError, UnavailableError
from loadmaster.common.gateway_config import ApiKeySettings
from loadmaster.gateway.auth import Authenticator
from loadmaster.gateway.frontends.anthropic import anthropic_routes
from loadmaster.gateway.frontends.dialect_calls import DialectCalls
from loadmaster.gateway.frontends.openai import openai_routes
from loadmaster.gateway.frontends.openai_schema import ChatCompletionBody
from loadmaster.gateway.generation import (
    MAX_CONTENT_PARTS,
    Finished,
    GenerationEvent,
    GenerationRequest,
    TextChunk,
)
from loadmaster.gateway.generation_items import FunctionSpec, ToolCall, ToolUse


def turns(request: GenerationRequest) -> tuple[tuple[str, str], ...] | None:
    """A request's chat as (role, text) pairs."""
    return None if request.messages is None else tuple((t.role, t.content) for t in request.messages)


class Recorded:
    """Answers every request with `pieces` (or fails as told); remembers what it was asked."""

    def __init__(
        self,
        pieces: list[str],
        *,
        finish: str = "stop",
        fail_before: Exception | None = None,
        fail_after: int | None = None,
        calls: tuple[ToolCall, ...] = (),
    ):
        self.pieces = pieces
        self.calls = calls
        self.finish = finish
        self.fail_before = fail_before
        self.fail_after = fail_after
        self.requests: list[tuple[GenerationRequest, str]] = []
        self.closed: list[str] = []

    async def generate(
        self, request: GenerationRequest, *, request_id: str, client_id: str, tenant: str = ""
    ) -> AsyncIterator[GenerationEvent]:
        self.requests.append((request, client_id))
        try:
            if self.fail_before is not None:
                raise self.fail_before
            for index, piece in enumerate(self.pieces):
                if self.fail_after is not None and index == self.fail_after:
                    raise UnavailableError("the worker died")
                yield TextChunk(piece)
            if self.calls:
                yield TextChunk("", tool_calls=self.calls)
            yield Finished(self.finish, prompt_tokens=9, completion_tokens=len(self.pieces))
        finally:
            self.closed.append(request_id)

    async def models(self) -> dict[str, str]:
        return {"tiny-chat": "READY", "tiny-vlm": "IDLE", "zeta": "IDLE"}


def app_for(generations: Recorded, keys: list[ApiKeySettings] | None = None) -> Starlette:
    auth = Authenticator(keys or [])
    openai_side = openai_routes(generations, auth, gateway_id="gw")
    endpoints = {route.path: route.endpoint for route in openai_side}
    routes = anthropic_routes(
        DialectCalls(generations, auth, client_type="anthropic"),
        models=generations.models,
        openai_models=endpoints["/v1/models"],
        openai_model=endpoints["/v1/models/{model:path}"],
        gateway_id="gw",
        max_body_bytes=1 << 20,
    )
    return Starlette(routes=[*routes, *openai_side])


def client_for(
    generations: Recorded, keys: list[ApiKeySettings] | None = None, api_key: str = "k"
) -> anthropic.AsyncAnthropic:
    http = httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app_for(generations, keys)), base_url="http://gateway"
    )
    return anthropic.AsyncAnthropic(
        base_url="http://gateway", api_key=api_key, http_client=http, max_retries=0
    )


HI: list[Any] = [{"role": "user", "content": "hi"}]


async def test_a_message_maps_its_fields_onto_the_openai_plane() -> None:
    generations = Recorded(["he", "llo"])
    message = await client_for(generations).messages.create(
        model="tiny-chat",
        max_tokens=2,
        system="be brief",
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}
        ],
        stop_sequences=["\n\n"],
        metadata={"user_id": "u-1"},
        extra_body={"temperature": 0.5, "top_p": 0.9},  # the 2.x client no longer has them as arguments
    )
    assert message.content[0].type == "text" and message.content[0].text == "hello"
    assert message.stop_reason == "end_turn" and message.role == "assistant" and message.model == "tiny-chat"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (9, 2)
    [(request, client_id)] = generations.requests
    assert turns(request) == (("system", "be brief"), ("user", "hi"))
    assert (request.max_tokens, request.temperature, request.top_p, request.stop) == (2, 0.5, 0.9, ("\n\n",))
    assert client_id == "u-1"


async def test_a_string_content_is_not_held_to_the_part_limit() -> None:
    generations = Recorded(["ok"])
    long = "word " * (4 * MAX_CONTENT_PARTS)
    await client_for(generations).messages.create(
        model="tiny-chat", max_tokens=2, messages=[{"role": "user", "content": long}]
    )
    [(request, _)] = generations.requests
    assert turns(request) == (("user", long),)


async def test_max_tokens_and_guardrail_stops_are_anthropic_stop_reasons() -> None:
    for finish, reason in (("length", "max_tokens"), ("content_filter", "refusal")):
        message = await client_for(Recorded(["a"], finish=finish)).messages.create(
            model="tiny-chat", max_tokens=1, messages=HI
        )
        assert message.stop_reason == reason


async def test_a_stream_follows_anthropics_event_order() -> None:
    generations = Recorded(["a", "", "b"], finish="length")
    client = client_for(generations)
    async with client.messages.stream(model="tiny-chat", max_tokens=3, messages=HI) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].text == "ab" and final.stop_reason == "max_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (9, 3)
    raw = await client.messages.with_raw_response.create(
        model="tiny-chat", max_tokens=3, messages=HI, stream=True
    )
    names = [
        line.removeprefix("event: ")
        for line in (await raw.http_response.aread()).decode().splitlines()
        if line.startswith("event: ")
    ]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


async def test_image_blocks_become_image_parts() -> None:
    generations = Recorded(["a"])
    data = base64.b64encode(b"\x89PNG\r\n\x1a\n....").decode()
    await client_for(generations).messages.create(
        model="tiny-vlm",
        max_tokens=1,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
                    {"type": "image", "source": {"type": "url", "url": "https://images.example/cat.png"}},
                    {"type": "text", "text": "what is it?"},
                ],
            }
        ],
    )
    [(request, _)] = generations.requests
    assert turns(request) == (("user", "what is it?"),)
    assert [(i.message, i.url) for i in request.images] == [
        (0, "data:image/png;base64," + data),
        (0, "https://images.example/cat.png"),
    ]


async def test_count_tokens_runs_the_prompt_for_one_token() -> None:
    generations = Recorded(["a"])
    counted = await client_for(generations).messages.count_tokens(model="tiny-chat", system="s", messages=HI)
    assert counted.input_tokens == 9
    [(request, _)] = generations.requests
    assert (
        request.max_tokens == 1
        and request.temperature == 0
        and turns(request) == (("system", "s"), ("user", "hi"))
    )


async def test_models_take_anthropics_shape_when_asked_in_anthropics_dialect() -> None:
    generations = Recorded([])
    client = client_for(generations)
    page = await client.models.list(limit=2)
    assert [m.id for m in page.data] == ["tiny-chat", "tiny-vlm"] and page.has_more
    assert page.data[0].type == "model" and page.data[0].display_name == "tiny-chat"
    later = await client.models.list(after_id="tiny-vlm")
    assert [m.id for m in later.data] == ["zeta"] and not later.has_more
    assert (await client.models.retrieve("zeta")).id == "zeta"
    with pytest.raises(anthropic.NotFoundError):
        await client.models.retrieve("nope")
    oai = openai.AsyncOpenAI(
        base_url="http://gateway/v1",
        api_key="k",
        http_client=httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app_for(generations)), base_url="http://gateway"
        ),
        max_retries=0,
    )
    assert [m.id for m in (await oai.models.list()).data] == ["tiny-chat", "tiny-vlm", "zeta"]
    assert (await oai.models.retrieve("zeta")).object == "model"


async def test_x_api_key_is_the_api_key() -> None:
    key = ApiKeySettings(name="team", sha256=hashlib.sha256(b"secret").hexdigest())
    generations = Recorded(["a"])
    with pytest.raises(anthropic.AuthenticationError) as caught:
        await client_for(generations, keys=[key], api_key="wrong").messages.create(
            model="tiny-chat", max_tokens=1, messages=HI
        )
    assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    message = await client_for(generations, keys=[key], api_key="secret").messages.create(
        model="tiny-chat", max_tokens=1, messages=HI
    )
    assert message.content[0].text == "a" and generations.requests[0][1] == "team"


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"top_k": 5}, "top_k"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        (
            {"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "g"}},
            "tool_choice",
        ),
        ({"temperature": 1.5}, "temperature"),
        ({"thinking": {"type": "adaptive"}}, "thinking.type"),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
        ({"output_config": {"effort": "high"}}, "output_config.effort"),
        ({"speed": "fast"}, "speed"),
        ({"messages": [*HI, {"role": "assistant", "content": "The answer is"}]}, "prefill"),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages.0.content.0.type",
        ),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": HI * 2049}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 257}]},
            "messages.0.content",
        ),
    ],
)
async def test_what_cannot_be_honoured_is_a_400_naming_it(extra: dict[str, Any], needle: str) -> None:
    generations = Recorded(["a"])
    body = {"model": "tiny-chat", "max_tokens": 1, "messages": HI, **extra}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app_for(generations)), base_url="http://gateway"
    ) as http:
        response = await http.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert response.status_code == 400, response.text
    payload = response.json()
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    assert needle in payload["error"]["message"]
    assert generations.requests == []


async def test_errors_keep_anthropics_shape_and_a_failure_mid_stream_ends_it() -> None:
    client = client_for(Recorded([], fail_before=NotFoundError("model 'nope' is not served")))
    with pytest.raises(anthropic.NotFoundError) as caught:
        await client.messages.create(model="nope", max_tokens=1, messages=HI)
    assert caught.value.body["error"] == {"type": "not_found_error", "message": "model 'nope' is not served"}  # type: ignore[index]
    generations = Recorded(["a", "b", "c"], fail_after=2)
    texts = []
    with pytest.raises(anthropic.APIStatusError, match="the worker died"):
        async with client_for(generations).messages.stream(
            model="tiny-chat", max_tokens=3, messages=HI
        ) as stream:
            async for text in stream.text_stream:
                texts.append(text)
    assert texts == ["a", "b"] and len(generations.closed) == 1


async def test_rate_limits_answer_429_with_retry_after() -> None:
    key = ApiKeySettings(name="team", sha256=hashlib.sha256(b"secret").hexdigest(), rate_per_s=1, burst=1)
    client = client_for(Recorded(["a"]), keys=[key], api_key="secret")
    await client.messages.create(model="tiny-chat", max_tokens=1, messages=HI)
    with pytest.raises(anthropic.RateLimitError) as caught:
        await client.messages.create(model="tiny-chat", max_tokens=1, messages=HI)
    assert caught.value.response.headers["retry-after"] == "1"
    assert caught.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]


async def test_loadmaster_headers_reach_the_request() -> None:
    generations = Recorded(["a"])
    await client_for(generations).messages.create(
        model="tiny-chat",
        max_tokens=1,
        messages=HI,
        extra_headers={"X-Loadmaster-Priority": "0", "X-Loadmaster-Deadline-Ms": "1500"},
    )
    [(request, _)] = generations.requests
    assert (request.priority, request.deadline_ms) == (0, 1500.0)
    body = json.dumps({"model": "tiny-chat", "max_tokens": 1, "messages": HI})
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app_for(generations)), base_url="http://gateway"
    ) as http:
        response = await http.post("/v1/messages", content=body, headers={"X-Loadmaster-Urgency": "2"})
    assert response.status_code == 400 and "X-Loadmaster-Urgency" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [(b"{not json", "not valid JSON"), (b"[" * 100_000, "not valid JSON"), (b"[1]", "object")],
)
async def test_a_body_that_is_not_a_json_object_is_a_400(body: bytes, needle: str) -> None:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app_for(Recorded(["a"]))), base_url="http://gateway"
    ) as http:
        response = await http.post("/v1/messages", content=body)
    assert response.status_code == 400 and needle in response.json()["error"]["message"], response.text


WEATHER = {
    "name": "get_weather",
    "description": "the weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


async def test_tools_and_tool_choice_become_function_tools() -> None:
    generations = Recorded(["a"])
    client = client_for(generations)
    await client.messages.create(model="tiny-chat", max_tokens=4, messages=HI, tools=[WEATHER])  # type: ignore[list-item]
    await client.messages.create(
        model="tiny-chat",
        max_tokens=4,
        messages=HI,
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},  # type: ignore[list-item]
    )
    await client.messages.create(
        model="tiny-chat",
        max_tokens=4,
        messages=HI,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},  # type: ignore[list-item]
    )
    function = FunctionSpec("get_weather", "the weather in a city", WEATHER["input_schema"])  # type: ignore[arg-type]
    assert [r.tools for r, _ in generations.requests] == [
        ToolUse((function,), choice="auto"),
        ToolUse((function,), choice="required", parallel=False),
        ToolUse((function,), choice="function", function_name="get_weather"),
    ]


async def test_tool_use_and_tool_result_blocks_are_the_chats_tool_turns() -> None:
    generations = Recorded(["sunny"])
    await client_for(generations).messages.create(
        model="tiny-chat",
        max_tokens=4,
        tools=[WEATHER],  # type: ignore[list-item]
        messages=[
            {"role": "user", "content": "weather in Oslo?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "let me look"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "12 C"}],
                    },
                    {"type": "text", "text": "and tomorrow?"},
                ],
            },
        ],
    )
    [(request, _)] = generations.requests
    assert request.messages is not None
    _, assistant, tool, follow_up = request.messages
    assert (assistant.role, assistant.content) == ("assistant", "let me look")
    assert assistant.tool_calls == (ToolCall("toolu_1", "get_weather", '{"city":"Oslo"}', 0),)
    assert (tool.role, tool.tool_call_id, tool.name, tool.content) == (
        "tool",
        "toolu_1",
        "get_weather",
        "12 C",
    )
    assert (follow_up.role, follow_up.content) == ("user", "and tomorrow?")


async def test_a_reply_with_tool_calls_is_tool_use_blocks() -> None:
    call = ToolCall("call_7", "get_weather", '{"city": "Oslo"}')
    client = client_for(Recorded(["checking"], finish="tool_calls", calls=(call,)))
    message = await client.messages.create(model="tiny-chat", max_tokens=8, messages=HI, tools=[WEATHER])  # type: ignore[list-item]
    assert message.stop_reason == "tool_use"
    text, used = message.content
    assert text.type == "text" and text.text == "checking"
    assert used.type == "tool_use" and (used.id, used.name, used.input) == (
        "call_7",
        "get_weather",
        {"city": "Oslo"},
    )
    async with client.messages.stream(
        model="tiny-chat", max_tokens=8, messages=HI, tools=[WEATHER]
    ) as stream:  # type: ignore[list-item]
        final = await stream.get_final_message()
    assert [block.type for block in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Oslo"} and final.stop_reason == "tool_use"  # type: ignore[union-attr]
    only_calls = client_for(Recorded([], finish="tool_calls", calls=(call,)))
    reply = await only_calls.messages.create(model="tiny-chat", max_tokens=8, messages=HI, tools=[WEATHER])  # type: ignore[list-item]
    assert [block.type for block in reply.content] == ["tool_use"]


async def test_thinking_is_the_thinking_switch_where_the_server_has_one() -> None:
    generations = Recorded(["a"])
    client = client_for(generations)
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    if "chat_template_kwargs" not in ChatCompletionBody.model_fields:
        with pytest.raises(anthropic.BadRequestError, match="thinking: this server has no thinking switch"):
            await client.messages.create(model="tiny-chat", max_tokens=1, messages=HI, thinking=thinking)
        return
    await client.messages.create(model="tiny-chat", max_tokens=1, messages=HI, thinking=thinking)
    [(request, _)] = generations.requests
    assert request.chat_template_kwargs == {"enable_thinking": True}  # type: ignore[attr-defined]


async def test_a_client_without_a_valid_key_is_refused_before_its_body_is_read() -> None:
    key = ApiKeySettings(name="team", sha256=hashlib.sha256(b"secret").hexdigest())
    transport = httpx.ASGITransport(app=app_for(Recorded(["a"]), keys=[key]))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            response = await http.post(path, content=b"{not json", headers={"x-api-key": "wrong"})
            assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
