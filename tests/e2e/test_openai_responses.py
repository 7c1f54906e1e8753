"""The official `openai` client's `responses.create` against the real suite: text from tiny-chat
streamed and not, a function call (forced from tiny-chat, read out of replay-chat's text),
a conversation carried in `input` items, and the 400 for `previous_response_id`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from loadmaster.cli.launcher import Suite
from loadmaster.v1 import model_pool_pb2, model_pool_pb2_grpc

CHAT = "tiny-chat"
REPLAY = "replay-chat"
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather",
    "parameters": PARAMETERS,
}


@pytest.fixture(scope="module")
def client(suite: Suite) -> Iterator[openai.OpenAI]:
    gateway = suite.settings.gateway
    url = f"http://{gateway.http_host}:{gateway.http_port}/v1"
    with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120) as client:
        yield client


def test_a_response_and_its_stream_carry_the_same_text(client: openai.OpenAI) -> None:
    reply = client.responses.create(
        model=CHAT, input="hello", instructions="be brief", max_output_tokens=12, temperature=0
    )
    assert reply.status == "incomplete" and reply.incomplete_details is not None  # 12 tokens, cut
    assert reply.output_text and reply.usage is not None and reply.usage.output_tokens == 12
    events = list(
        client.responses.create(
            model=CHAT,
            input="hello",
            instructions="be brief",
            max_output_tokens=12,
            temperature=0,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert deltas == reply.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_forced_function_call_validates_and_an_auto_one_is_read_from_text(client: openai.OpenAI) -> None:
    forced = client.responses.create(
        model=CHAT,
        input="weather?",
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,  # exactly one call (sampled: it could otherwise make two)
        max_output_tokens=200,
    )
    [call] = [item for item in forced.output if item.type == "function_call"]
    assert call.name == "get_weather" and forced.status == "completed"
    jsonschema.validate(json.loads(call.arguments), PARAMETERS)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    events = list(client.responses.create(model=REPLAY, input=text, tools=[TOOL], stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Oslo"}  # type: ignore[union-attr]
    assert events[-1].type == "response.completed"


def test_the_conversation_travels_in_input_items_not_in_stored_state(client: openai.OpenAI) -> None:
    reply = client.responses.create(
        model=REPLAY,
        input=[
            {"role": "user", "content": "weather?"},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "rain"},
            {"role": "user", "content": "thanks, and tomorrow?"},
        ],
        tools=[TOOL],
    )
    assert reply.output_text == "thanks, and tomorrow?"  # replay-chat answers the last user turn
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=CHAT, input="more", previous_response_id=reply.id)
    assert "not kept" in str(caught.value)


def worker_inflight(suite: Suite, model: str) -> int:
    with grpc.insecure_channel(suite.settings.model_pool.address) as channel:
        reply = model_pool_pb2_grpc.ModelPoolServiceStub(channel).Status(
            model_pool_pb2.StatusRequest(), timeout=5
        )
    return next((m.inflight for m in reply.models if m.model_id == model), 0)


async def test_a_client_that_leaves_a_response_stream_frees_its_sequence(suite: Suite) -> None:
    gateway = suite.settings.gateway
    url = f"http://{gateway.http_host}:{gateway.http_port}/v1"
    async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=120) as client:
        stream = await client.responses.create(
            model=CHAT, input="go on", max_output_tokens=1500, temperature=0, stream=True
        )
        deltas = 0
        async for event in stream:
            deltas += event.type == "response.output_text.delta"
            if deltas >= 3:
                break
        assert worker_inflight(suite, CHAT) == 1
        await stream.close()
        for _ in range(100):  # bounded: 100 x 20 ms
            if worker_inflight(suite, CHAT) == 0:
                break
            await asyncio.sleep(0.02)
        assert worker_inflight(suite, CHAT) == 0, "the abandoned response still holds its sequence"
