"""The official `openai` client's `embeddings.create` against the real suite with `tiny-embed`
(a random BERT on the embedding engine): strings, lists, token ids, float and base64,
`dimensions`, concurrent requests batched on the worker, and 400s naming the input.

tiny-embed is not preloaded: the first test pays for its load."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator

import grpc
import httpx
import numpy as np
import openai
import pytest

from loadmaster.cli.launcher import Suite
from loadmaster.v1 import metrics_pb2, metrics_pb2_grpc

MODEL = "tiny-embed"


@pytest.fixture(scope="module")
def base_url(suite: Suite) -> str:
    gateway = suite.settings.gateway
    return f"http://{gateway.http_host}:{gateway.http_port}/v1"


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120) as client:
        yield client


def test_texts_and_token_ids_come_back_as_unit_vectors_in_order(client: openai.OpenAI) -> None:
    reply = client.embeddings.create(model=MODEL, input=["hello world", "a second, longer input"])
    assert reply.model == MODEL and [d.index for d in reply.data] == [0, 1]
    vectors = np.array([d.embedding for d in reply.data])
    assert vectors.shape == (2, 64) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    assert not np.allclose(vectors[0], vectors[1])
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > 2
    alone = client.embeddings.create(model=MODEL, input="hello world", encoding_format="float")
    assert np.allclose(alone.data[0].embedding, vectors[0], atol=1e-5)  # batch mates change nothing
    ids = [int(t) for t in np.arange(3, 12)]
    by_ids = client.embeddings.create(model=MODEL, input=[ids, ids[:4]])
    assert len(by_ids.data) == 2 and by_ids.usage.prompt_tokens == 13


def test_float_and_base64_carry_the_same_vectors_and_dimensions_shorten_them(base_url: str) -> None:
    def post(**fields: object) -> dict[str, object]:
        reply = httpx.post(
            base_url + "/embeddings", json={"model": MODEL, "input": "same", **fields}, timeout=60
        )
        assert reply.status_code == 200, reply.text
        return reply.json()  # type: ignore[no-any-return]

    floats = post(encoding_format="float")["data"][0]["embedding"]  # type: ignore[index]
    packed = post(encoding_format="base64")["data"][0]["embedding"]  # type: ignore[index]
    assert np.array_equal(
        np.frombuffer(base64.b64decode(packed), dtype="<f4"), np.array(floats, dtype=np.float32)
    )
    short = post(encoding_format="float", dimensions=16)["data"][0]["embedding"]  # type: ignore[index]
    assert len(short) == 16 and np.isclose(np.linalg.norm(short), 1.0, atol=1e-4)
    expected = np.array(floats[:16]) / np.linalg.norm(floats[:16])
    assert np.allclose(short, expected, atol=1e-5)


def largest_batch(suite: Suite) -> float:
    """The most requests one forward pass of tiny-embed took, as the worker reported it."""
    with grpc.insecure_channel(suite.settings.metrics.address) as channel:
        stub = metrics_pb2_grpc.MetricsServiceStub(channel)
        request = metrics_pb2.GetStatsRequest(name="batch_size", labels={"model": MODEL})
        return float(stub.GetStats(request, timeout=5).stats.max)


async def test_concurrent_requests_batch_on_the_worker_each_with_its_own_vectors(
    base_url: str, suite: Suite
) -> None:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120) as client:
        texts = [f"input number {i}" for i in range(24)]
        replies = await asyncio.gather(*(client.embeddings.create(model=MODEL, input=t) for t in texts))
        batch = await client.embeddings.create(model=MODEL, input=texts)
    for reply, expected in zip(replies, batch.data, strict=True):
        assert np.allclose(reply.data[0].embedding, expected.embedding, atol=1e-5)
    for _ in range(50):  # bounded: the worker's reporter flushes every 250 ms
        if largest_batch(suite) > 1:
            break
        await asyncio.sleep(0.1)
    assert largest_batch(suite) > 1  # 24 concurrent requests shared forward passes


def test_what_the_model_cannot_do_is_a_400_naming_it(client: openai.OpenAI) -> None:
    for kwargs, words in (
        ({"input": "x", "dimensions": 8}, "dimensions: 8"),
        ({"input": ""}, "input[0]: empty"),
        ({"input": [[1, 99999]]}, "token id 99999"),
        ({"input": "word " * 600}, "takes at most 512"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.embeddings.create(model=MODEL, **kwargs)  # type: ignore[arg-type]
        assert words in str(caught.value), (words, caught.value)
    assert client.embeddings.create(model=MODEL, input="still serving").data
