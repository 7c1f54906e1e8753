"""The Ollama and Anthropic dialects and images in chat, with the official `ollama`, `anthropic` and
`openai` clients against the real suite (gateway -> scheduler -> model-pool worker -> engines):
`tiny-chat` (transformers continuous batching) and `tiny-vlm` (the vision-language engine).

Neither model is preloaded: the first test that uses each pays for its cold load."""

from __future__ import annotations

import asyncio
import base64
import io
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import grpc
import httpx
import numpy as np
import ollama
import openai
import pytest
from PIL import Image

from loadmaster.cli.launcher import Suite
from loadmaster.v1 import model_pool_pb2, model_pool_pb2_grpc

CHAT, VLM = "tiny-chat", "tiny-vlm"


@pytest.fixture(scope="module")
def host(suite: Suite) -> Iterator[str]:
    gateway = suite.settings.gateway
    url = f"http://{gateway.http_host}:{gateway.http_port}"
    warm = ollama.Client(host=url, timeout=120)
    for model in (CHAT, VLM):  # cold loads, once per module
        warm.chat(model=model, messages=[{"role": "user", "content": "hi"}], options={"num_predict": 1})
    yield url


def png(seed: int) -> bytes:
    pixels = (np.random.default_rng(seed).random((40, 48, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def inflight(suite: Suite, model: str) -> int:
    with grpc.insecure_channel(suite.settings.model_pool.address) as channel:
        reply = model_pool_pb2_grpc.ModelPoolServiceStub(channel).Status(
            model_pool_pb2.StatusRequest(), timeout=5
        )
    return next(m.inflight for m in reply.models if m.model_id == model)


async def until_idle(suite: Suite, model: str) -> None:
    for _ in range(150):  # bounded: 150 x 20 ms
        if inflight(suite, model) == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{model}: a generation still holds its sequence after its client left")


# --- images -----------------------------------------------------------------------------------


def test_an_image_chat_reaches_the_vision_language_model(host: str) -> None:
    client = openai.OpenAI(base_url=host + "/v1", api_key="none", max_retries=0, timeout=60)

    def ask(*images: bytes) -> Any:
        parts: list[Any] = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
        parts.append({"type": "text", "text": "what is in the picture?"})
        return client.chat.completions.create(
            model=VLM, messages=[{"role": "user", "content": parts}], max_tokens=8, temperature=0
        )

    text_only = client.chat.completions.create(
        model=VLM,
        messages=[{"role": "user", "content": "what is in the picture?"}],
        max_tokens=8,
        temperature=0,
    )
    one, again, two = ask(png(1)), ask(png(1)), ask(png(1), png(2))
    assert one.choices[0].message.content and one.choices[0].finish_reason == "length"
    assert one.choices[0].message.content == again.choices[0].message.content  # greedy
    assert one.usage is not None and text_only.usage is not None and two.usage is not None
    assert one.usage.prompt_tokens == text_only.usage.prompt_tokens + 16  # the image's tokens
    assert two.usage.prompt_tokens == one.usage.prompt_tokens + 16
    assert "tiny-vlm" in [m.id for m in client.models.list()]


def test_a_model_that_takes_no_images_says_so(host: str) -> None:
    client = openai.OpenAI(base_url=host + "/v1", api_key="none", max_retries=0, timeout=60)
    content: Any = [
        {"type": "image_url", "image_url": {"url": data_url(png(3))}},
        {"type": "text", "text": "hi"},
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=CHAT, messages=[{"role": "user", "content": content}], max_tokens=4
        )
    assert "model 'tiny-chat' takes no images" in caught.value.message
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=host).chat(
            model=CHAT, messages=[{"role": "user", "content": "hi", "images": [png(3)]}]
        )
    assert refused.value.status_code == 400 and "takes no images" in refused.value.error
    content[0]["image_url"]["url"] = "https://images.example/cat.png"
    with pytest.raises(openai.BadRequestError, match=r"not in gateway\.image_url_allow"):
        client.chat.completions.create(
            model=VLM, messages=[{"role": "user", "content": content}], max_tokens=4
        )


# --- Ollama --------------------------------------------------------------------------------------


def test_ollama_chat_streamed_and_not(host: str) -> None:
    client = ollama.Client(host=host, timeout=60)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    options = {"temperature": 0, "num_predict": 12}
    whole = client.chat(model=CHAT + ":latest", messages=messages, options=options)
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 12
    assert whole.message.role == "assistant" and whole.message.content
    assert whole.prompt_eval_count and whole.prompt_eval_count > 4
    parts = list(client.chat(model=CHAT, messages=messages, options=options, stream=True))
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    generated = client.generate(model=CHAT, prompt="hello", system="be brief", options=options)
    assert generated.response == whole.message.content  # the same prompt, through the template


def test_ollama_images_list_ps_show(host: str) -> None:
    client = ollama.Client(host=host, timeout=60)
    answer = client.chat(
        model=VLM,
        messages=[{"role": "user", "content": "what?", "images": [png(4)]}],
        options={"num_predict": 4, "temperature": 0},  # sampled, the tiny model may end at once
    )
    assert answer.eval_count == 4
    names = [m.model for m in client.list().models]
    assert CHAT + ":latest" in names and VLM + ":latest" in names
    assert CHAT + ":latest" in [m.model for m in client.ps().models]
    assert "vision" in (client.show(VLM).capabilities or [])


async def test_an_ollama_client_that_disconnects_frees_its_sequence(suite: Suite, host: str) -> None:
    await until_idle(suite, CHAT)  # an earlier test's stream ended at its client, maybe not yet here
    body = {
        "model": CHAT,
        "messages": [{"role": "user", "content": "go on"}],
        "options": {"num_predict": 1500},
    }
    async with (
        httpx.AsyncClient(base_url=host, timeout=60) as http,
        http.stream("POST", "/api/chat", json=body) as response,
    ):
        lines = 0
        async for _ in response.aiter_lines():
            lines += 1
            if lines >= 3:
                break
        assert inflight(suite, CHAT) == 1
    await until_idle(suite, CHAT)


# --- Anthropic -----------------------------------------------------------------------------------


def test_anthropic_messages_streamed_and_not(host: str) -> None:
    client = anthropic.Anthropic(base_url=host, api_key="none", max_retries=0, timeout=60)
    kwargs: Any = {
        "model": CHAT,
        "max_tokens": 12,
        "system": "be brief",
        "messages": [{"role": "user", "content": "hello"}],
    }
    whole = client.messages.create(**kwargs, extra_body={"temperature": 0})
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    assert whole.content[0].type == "text" and whole.content[0].text
    with client.messages.stream(**kwargs, extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text and final.usage.input_tokens == whole.usage.input_tokens
    counted = client.messages.count_tokens(model=CHAT, system="be brief", messages=kwargs["messages"])
    assert counted.input_tokens == whole.usage.input_tokens
    assert CHAT in [m.id for m in client.models.list()]


def test_anthropic_image_block(host: str) -> None:
    client = anthropic.Anthropic(base_url=host, api_key="none", max_retries=0, timeout=60)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(5)).decode()}
    message = client.messages.create(
        model=VLM,
        max_tokens=4,
        extra_body={"temperature": 0},  # sampled, the tiny model may end before its 4 tokens
        messages=[
            {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": "?"}]}
        ],
    )
    assert message.usage.output_tokens == 4 and message.usage.input_tokens > 16


async def test_an_anthropic_client_that_disconnects_frees_its_sequence(suite: Suite, host: str) -> None:
    await until_idle(suite, CHAT)  # an earlier test's stream ended at its client, maybe not yet here
    client = anthropic.AsyncAnthropic(base_url=host, api_key="none", max_retries=0, timeout=60)
    async with client.messages.stream(
        model=CHAT, max_tokens=1500, messages=[{"role": "user", "content": "go on"}]
    ) as stream:
        seen = 0
        async for _ in stream.text_stream:
            seen += 1
            if seen >= 3:
                break
        assert inflight(suite, CHAT) == 1
    started = time.monotonic()
    await until_idle(suite, CHAT)
    print(f"sequence freed {(time.monotonic() - started) * 1e3:.0f} ms after the client left")


WEATHER: Any = {
    "name": "get_weather",
    "description": "the weather in a city",
    # maxLength: a random model never ends a free string by itself; constrained, it must
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
    },
}


REPLAY = "replay-chat"  # replays the user's text: a scripted reply with a Hermes tool call
SCRIPT = 'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


def test_anthropic_messages_with_a_tool_streamed_and_not(host: str) -> None:
    client = anthropic.Anthropic(base_url=host, api_key="none", max_retries=0, timeout=60)
    kwargs: Any = {
        "model": REPLAY,
        "max_tokens": 256,
        "messages": [{"role": "user", "content": SCRIPT}],
        "tools": [WEATHER],
    }
    message = client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    assert [block.type for block in message.content] == ["text", "tool_use"]
    text, used = message.content
    assert text.text.strip() == "Checking."  # type: ignore[union-attr]
    assert (used.name, used.input) == ("get_weather", {"city": "Oslo"})  # type: ignore[union-attr]
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Oslo"}  # type: ignore[union-attr]
    assert kinds.count("content_block_start") == 2 and kinds[-1] == "message_stop"
    answered = client.messages.create(
        model=CHAT,
        max_tokens=4,
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "weather in Oslo?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": used.id, "name": "get_weather", "input": {"city": "Oslo"}}
                ],
            },  # type: ignore[union-attr]
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": used.id, "content": "12 C"}]},  # type: ignore[union-attr]
        ],
    )
    asked = client.messages.create(
        model=CHAT, max_tokens=4, tools=[WEATHER], messages=[{"role": "user", "content": "weather in Oslo?"}]
    )
    assert (
        answered.usage.input_tokens > asked.usage.input_tokens
    )  # the call and its result reach tiny-chat's template


def test_ollama_chat_with_tools(host: str) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"]}}
    client = ollama.Client(host=host, timeout=60)
    reply = client.chat(model=REPLAY, messages=[{"role": "user", "content": SCRIPT}], tools=[tool])
    assert reply.done and reply.message.tool_calls is not None
    [call] = reply.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", {"city": "Oslo"})
    parts = list(
        client.chat(model=REPLAY, messages=[{"role": "user", "content": SCRIPT}], tools=[tool], stream=True)
    )
    assert [c.function.arguments for p in parts for c in p.message.tool_calls or []] == [{"city": "Oslo"}]


def test_a_forced_tool_call_from_tiny_chat_through_anthropics_dialect(host: str) -> None:
    schema = {**WEATHER["input_schema"], "additionalProperties": False}  # a closed object: the call ends
    client = anthropic.Anthropic(base_url=host, api_key="none", max_retries=0, timeout=60)
    kwargs: Any = {
        "model": CHAT,
        "max_tokens": 96,
        "messages": [{"role": "user", "content": "weather in Oslo?"}],
        "tools": [{**WEATHER, "input_schema": schema}],
        "tool_choice": {"type": "tool", "name": "get_weather"},  # decoding constrained to the schema
        "extra_body": {"temperature": 0},
    }
    message = client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    [used] = [block for block in message.content if block.type == "tool_use"]
    assert used.name == "get_weather" and set(used.input) == {"city"} and len(used.input["city"]) <= 8  # type: ignore[arg-type,index]
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [used.input]  # greedy: the same call


def test_ollama_embed(host: str) -> None:
    client = ollama.Client(host=host, timeout=60)
    reply = client.embed(model="tiny-embed", input=["a robot arm", "a gripper", "a robot arm"])
    vectors = np.asarray(reply.embeddings, dtype=np.float32)
    assert vectors.shape[0] == 3 and vectors.shape[1] > 8 and reply.prompt_eval_count
    assert np.allclose(vectors[0], vectors[2]) and not np.allclose(vectors[0], vectors[1])
    same = openai.OpenAI(base_url=host + "/v1", api_key="none", max_retries=0).embeddings.create(
        model="tiny-embed", input="a robot arm"
    )
    assert np.allclose(same.data[0].embedding, vectors[0], atol=1e-5)  # the same model, the same call
    older = client.embeddings(model="tiny-embed", prompt="a gripper").embedding
    assert np.allclose(older, vectors[1], atol=1e-5)
    assert "tiny-embed:latest" in [m.model for m in client.list().models]
