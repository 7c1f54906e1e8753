"""`POST /v1/responses` driven in-process (ASGI, no sockets) by the official `openai` client
over a scripted stand-in for the rest of the gateway: text and function calls, streamed in
OpenAI's event order and not, input items and instructions translated into the chat the
model sees, and the 400s of a stateless server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from starlette.applications import Starlette

from loadmaster.common.errors import UnavailableError
from loadmaster.gateway.auth import Authenticator
from loadmaster.gateway.frontends.openai import openai_routes
from loadmaster.gateway.generation import Finished, GenerationEvent, GenerationRequest, TextChunk
from loadmaster.gateway.generation_items import ChatTurn, ToolCall

CALL = ToolCall("call_abc", "get_weather", '{"city":"Oslo"}', 0)
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


class Scripted:
    """Answers with `events` (then a Finished), remembering the requests."""

    def __init__(
        self, chunks: list[TextChunk], finish: str = "stop", *, fail_after: int | None = None
    ) -> None:
        self.chunks = chunks
        self.finish = finish
        self.fail_after = fail_after
        self.requests: list[GenerationRequest] = []
        self.closed = 0

    async def generate(
        self, request: GenerationRequest, *, request_id: str, client_id: str, tenant: str = ""
    ) -> AsyncIterator[GenerationEvent]:
        self.requests.append(request)
        try:
            for index, chunk in enumerate(self.chunks):
                if index == self.fail_after:
                    raise UnavailableError("the worker died")
                yield chunk
            yield Finished(self.finish, prompt_tokens=7, completion_tokens=5)
        finally:
            self.closed += 1

    async def models(self) -> dict[str, str]:
        return {"tiny-chat": "READY"}


def client_for(generations: Scripted) -> openai.AsyncOpenAI:
    app = Starlette(routes=openai_routes(generations, Authenticator([]), gateway_id="gw"))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
    return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="k", http_client=http, max_retries=0)


async def test_a_response_carries_text_then_function_calls_and_usage() -> None:
    generations = Scripted(
        [TextChunk("Let me "), TextChunk("check."), TextChunk("", tool_calls=(CALL,))], "tool_calls"
    )
    reply = await client_for(generations).responses.create(
        model="tiny-chat",
        input="weather in Oslo?",
        instructions="be brief",
        tools=[TOOL],
        max_output_tokens=50,
    )
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.status == "completed"
    assert reply.output_text == "Let me check."
    message, call = reply.output
    assert message.type == "message" and call.type == "function_call"
    assert (call.call_id, call.name, call.arguments) == ("call_abc", "get_weather", '{"city":"Oslo"}')
    assert reply.usage is not None and (reply.usage.input_tokens, reply.usage.output_tokens) == (7, 5)
    assert reply.store is False and reply.max_output_tokens == 50
    [request] = generations.requests
    assert request.messages == (ChatTurn("system", "be brief"), ChatTurn("user", "weather in Oslo?"))
    assert request.max_tokens == 50 and request.tools is not None
    assert request.tools.functions[0].name == "get_weather"


async def test_max_output_tokens_reached_is_an_incomplete_response() -> None:
    reply = await client_for(Scripted([TextChunk("abc")], "length")).responses.create(
        model="tiny-chat", input="x"
    )
    assert reply.status == "incomplete" and reply.incomplete_details is not None
    assert reply.incomplete_details.reason == "max_output_tokens"


async def test_a_streamed_response_follows_openais_event_order() -> None:
    generations = Scripted(
        [TextChunk("Hi"), TextChunk(" there"), TextChunk("", tool_calls=(CALL,))], "tool_calls"
    )
    stream = await client_for(generations).responses.create(
        model="tiny-chat", input="x", tools=[TOOL], stream=True
    )
    events = [event async for event in stream]
    assert [event.type for event in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[6].text == "Hi there" and events[11].arguments == '{"city":"Oslo"}'  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == "Hi there" and final.output[1].name == "get_weather"
    assert [event.output_index for event in events[2:13]] == [0] * 7 + [1] * 4  # type: ignore[union-attr]


async def test_a_stream_that_fails_after_it_began_ends_with_error_and_failed() -> None:
    generations = Scripted([TextChunk("a"), TextChunk("b")], fail_after=1)
    stream = await client_for(generations).responses.create(model="tiny-chat", input="x", stream=True)
    events = [event async for event in stream]
    assert [event.type for event in events][-3:] == ["response.output_text.delta", "error", "response.failed"]
    assert events[-2].message == "the worker died"  # type: ignore[union-attr]
    assert events[-1].response.status == "failed" and generations.closed == 1  # type: ignore[union-attr]


async def test_input_items_with_calls_and_their_outputs_become_the_chat_history() -> None:
    generations = Scripted([TextChunk("ok")])
    await client_for(generations).responses.create(
        model="tiny-chat",
        input=[
            {"role": "developer", "content": "rules"},
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        ],
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
    )
    [request] = generations.requests
    assert request.messages == (
        ChatTurn("system", "rules"),
        ChatTurn("user", "weather?"),
        ChatTurn("assistant", "", tool_calls=(ToolCall("c1", "get_weather", '{"city":"Oslo"}'),)),
        ChatTurn("tool", "rain", tool_call_id="c1", name="get_weather"),
    )
    assert request.tools is not None
    assert (request.tools.choice, request.tools.function_name, request.tools.parallel) == (
        "function",
        "get_weather",
        False,
    )


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "not kept"),
        ({"store": True}, "store", "not kept"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "not supported"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "function tools only"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]", "not supported"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content",
            "text parts only",
        ),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format", "yaml"),
        ({"input": [{"role": "user", "content": "x"}] * 2049}, "input", "at most 2048 items"),
    ],
)
async def test_what_a_stateless_server_cannot_honour_is_a_400_naming_it(
    fields: dict[str, Any], param: str, words: str
) -> None:
    generations = Scripted([TextChunk("x")])
    body = {"model": "tiny-chat", "input": "hi", **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        await client_for(generations).post("/responses", body=body, cast_to=httpx.Response)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param and words in error["message"], json.dumps(
        error
    )
    assert generations.requests == []
