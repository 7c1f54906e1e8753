"""The official `openai` client against the real suite (gateway -> scheduler -> model-pool worker ->
transformers engine) with `tiny-chat`: chat and text completions, sync and async, streaming and
not; SSE framing and usage; cancellation on disconnect; 32 concurrent streams; bad input.
Priorities and tenants: tests/e2e/test_generation_scheduling.py.

tiny-chat is not preloaded: the first test that uses it pays for its cold load."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest

from loadmaster.cli.launcher import Suite
from loadmaster.v1 import model_pool_pb2, model_pool_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = ROOT / "examples" / "loadmaster.yaml"
MODELS_DIR = ROOT / "examples" / "models"
MODEL = "tiny-chat"
CONTEXT = 2048  # tiny-chat's max_position_embeddings (its KV cache holds 4096 tokens)


@pytest.fixture(scope="module")
def base_url(suite: Suite) -> Iterator[str]:
    gateway = suite.settings.gateway
    url = f"http://{gateway.http_host}:{gateway.http_port}/v1"
    warm = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    warm.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    yield url


@pytest.fixture()
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60)


@pytest.fixture()
def async_client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)


def chat(text: str) -> list[Any]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]


def worker_inflight(suite: Suite) -> int:
    with grpc.insecure_channel(suite.settings.model_pool.address) as channel:
        reply = model_pool_pb2_grpc.ModelPoolServiceStub(channel).Status(
            model_pool_pb2.StatusRequest(), timeout=5
        )
    return next(m.inflight for m in reply.models if m.model_id == MODEL)


def test_a_chat_completion_answers_with_text_usage_and_the_model(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=chat("hello"), max_tokens=16, temperature=0, extra_body={"x_priority": 1}
    )
    reply = raw.parse()
    assert raw.headers["x-loadmaster-model"] == MODEL and reply.model == MODEL
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 16 and reply.usage.prompt_tokens > 4
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 16
    again = client.chat.completions.create(model=MODEL, messages=chat("hello"), max_tokens=16, temperature=0)
    assert again.choices[0].message.content == reply.choices[0].message.content  # greedy: reproducible


async def test_an_async_stream_carries_the_same_text_then_usage(
    client: openai.OpenAI, async_client: openai.AsyncOpenAI
) -> None:
    whole = client.chat.completions.create(
        model=MODEL, messages=chat("stream me"), max_tokens=24, temperature=0
    )
    stream = await async_client.chat.completions.create(
        model=MODEL,
        messages=chat("stream me"),
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 24 and whole.usage is not None
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_the_sse_framing_is_data_events_then_done(base_url: str) -> None:
    body = {
        "model": MODEL,
        "prompt": "once upon",
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", base_url + "/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-loadmaster-model"] == MODEL
        raw = "".join(response.iter_text())
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: ") :]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(p["object"] == "text_completion" for p in payloads)
    assert payloads[-1]["usage"]["completion_tokens"] == 8 and payloads[-1]["choices"] == []
    assert [p["choices"][0]["finish_reason"] for p in payloads[:-1]][-1] == "length"


def test_generations_report_tokens_and_latencies_to_metrics(
    client: openai.OpenAI, metrics_count: Callable[[str, dict[str, str]], int]
) -> None:
    labels = {"model": MODEL}
    before = metrics_count("output_tokens", labels)
    client.completions.create(model=MODEL, prompt="count me", max_tokens=12, temperature=0)
    names = ("output_tokens", "prompt_tokens", "time_to_first_token_ms", "inter_token_latency_ms")
    for _ in range(50):  # bounded: reporters flush every 250 ms
        counts = {name: metrics_count(name, labels) for name in names}
        if counts["output_tokens"] >= before + 12 and all(counts.values()):
            break
        time.sleep(0.1)
    assert counts["output_tokens"] >= before + 12 and all(counts.values()), counts


def test_models_lists_the_generative_model_with_its_state(client: openai.OpenAI) -> None:
    listed = {m.id: m for m in client.models.list()}
    assert MODEL in listed and "double" not in listed  # tensor models are not listed
    assert listed[MODEL].model_extra is not None and listed[MODEL].model_extra["x_state"] == "READY"
    assert client.models.retrieve(MODEL).id == MODEL


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "word " * 3000}]}, 400, f"({CONTEXT} tokens)"),
        ({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404, "no-such-model"),
    ],
)
def test_bad_input_is_an_openai_error_naming_the_field(
    base_url: str, body: dict[str, Any], status: int, needle: str
) -> None:
    reply = httpx.post(base_url + "/chat/completions", json={"model": MODEL, **body}, timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert needle in error["message"] or needle == error["param"], error


async def test_a_client_that_disconnects_frees_its_sequence(
    suite: Suite, async_client: openai.AsyncOpenAI
) -> None:
    stream = await async_client.chat.completions.create(
        model=MODEL, messages=chat("go on"), max_tokens=1500, temperature=0, stream=True
    )
    seen = 0
    async for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen >= 3:
            break
    assert worker_inflight(suite) == 1
    await stream.close()
    closed = time.monotonic()
    for _ in range(100):  # bounded: 100 x 20 ms
        if worker_inflight(suite) == 0:
            break
        await asyncio.sleep(0.02)
    freed_ms = (time.monotonic() - closed) * 1e3
    print(f"sequence freed {freed_ms:.0f} ms after the client left")
    assert worker_inflight(suite) == 0, "the cancelled generation still holds its sequence"


@pytest.mark.slow
async def test_32_concurrent_streams_each_get_their_own_tokens(
    client: openai.OpenAI, async_client: openai.AsyncOpenAI
) -> None:
    prompts = [f"request number {i}: tell me about {i * 7}" for i in range(32)]
    alone = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0).choices[0].text
        for p in prompts
    ]

    async def streamed(prompt: str) -> str:
        stream = await async_client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    together = await asyncio.gather(*(streamed(p) for p in prompts))
    assert list(together) == alone
    assert len(set(alone)) > 1
