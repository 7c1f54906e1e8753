"""Log probabilities from the transformers engine (engines/_logprobs.py) with tiny-chat on CPU:
they are the distribution the sampler drew from (checked against the model's own logits
through the same warp), per token, with the top alternatives; greedy reports temperature 1;
a preempted and resumed sequence keeps every token's record; rows that did not ask get none."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loadmaster.model_pool.engines import EngineContext
from loadmaster.model_pool.engines._seeded_sampling import pack_warp, warp
from loadmaster.model_pool.engines.transformers import TransformersEngine
from loadmaster.model_pool.generation import (
    GenerationEnd,
    GenerationRequest,
    SamplingParams,
    TokenLogprob,
)
from loadmaster.model_pool.repository import ModelRepository

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"


@pytest.fixture(scope="module")
def engine() -> Iterator[TransformersEngine]:
    instance = TransformersEngine(
        ModelRepository(EXAMPLES / "models").spec("tiny-chat"), EngineContext(device="cpu", threads=1)
    )
    instance.load()
    yield instance
    instance.unload()


async def generate(
    engine: TransformersEngine, request: GenerationRequest, *, preempt_after: int = 0
) -> tuple[list[int], list[TokenLogprob], GenerationEnd]:
    ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    async with asyncio.timeout(60):
        async for event in await engine.submit(request):
            if isinstance(event, GenerationEnd):
                return ids, logprobs, event
            ids.extend(event.token_ids)
            logprobs.extend(event.logprobs)
            if preempt_after and len(ids) >= preempt_after:
                preempt_after = 0
                urgent = GenerationRequest("urgent", SamplingParams(max_tokens=4), prompt="now", priority=0)
                async for _ in await engine.submit(urgent):  # on a full engine it pauses this one
                    pass
    raise AssertionError("no terminal")


def reference(
    engine: TransformersEngine, prompt: list[int], ids: list[int], *, temperature: float, top_p: float
) -> torch.Tensor:
    """Each generated position's log probabilities, from the model's own logits and `warp`."""
    with torch.inference_mode():
        logits = engine._model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    packed = torch.full((logits.size(0),), pack_warp(temperature or 1.0, top_p), dtype=torch.int32)
    return torch.log_softmax(warp(logits, packed, branch=True), dim=-1)


@pytest.mark.parametrize(("temperature", "top_p"), [(0.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
async def test_logprobs_are_the_sampled_distribution(
    engine: TransformersEngine, temperature: float, top_p: float
) -> None:
    request = GenerationRequest(
        f"lp-{temperature}-{top_p}",
        SamplingParams(max_tokens=8, temperature=temperature, top_p=top_p, seed=11),
        prompt="hello there",
        logprobs=4,
    )
    ids, logprobs, end = await generate(engine, request)
    assert len(logprobs) == len(ids) == end.usage.completion_tokens == 8
    prompt = engine._tokenizer.encode("hello there", add_special_tokens=True)
    expected = reference(engine, prompt, ids, temperature=temperature, top_p=top_p)
    for position, (token, item) in enumerate(zip(ids, logprobs, strict=True)):
        assert item.token_id == token and item.token == engine._grammars.tokenizer().decode_bytes([token])
        assert item.logprob == pytest.approx(float(expected[position, token]), abs=1e-3)
        assert len(item.top) == 4
        values, tokens = expected[position].topk(4)
        assert [t.token_id for t in item.top] == tokens.tolist()
        assert [t.logprob for t in item.top] == pytest.approx(values.tolist(), abs=1e-3)
        if temperature == 0.0:
            assert item.top[0].token_id == token  # greedy draws the most likely
        if top_p < 1.0:
            finite = [t for t in item.top if math.isfinite(t.logprob)]
            assert math.isfinite(item.logprob) and finite  # the drawn token was inside top_p


async def test_only_rows_that_ask_get_logprobs_and_nothing_is_left_behind(engine: TransformersEngine) -> None:
    asked = GenerationRequest(
        "asked", SamplingParams(max_tokens=6, temperature=0.0), prompt="one", logprobs=0
    )
    free = GenerationRequest("free", SamplingParams(max_tokens=6, temperature=0.0), prompt="two")
    (ids, logprobs, _), (free_ids, free_logprobs, _) = await asyncio.gather(
        generate(engine, asked), generate(engine, free)
    )
    assert len(logprobs) == len(ids) == 6 and all(item.top == () for item in logprobs)
    assert free_logprobs == [] and len(free_ids) == 6
    assert engine._logprobs.pending == 0


async def test_a_preempted_sequence_keeps_a_logprob_for_every_token() -> None:
    spec = ModelRepository(EXAMPLES / "models").spec("tiny-chat")
    one = spec.config.model_copy(update={"max_sequences": 1, "max_resident_sequences": 1})
    engine = TransformersEngine(dataclasses.replace(spec, config=one), EngineContext(device="cpu", threads=1))
    await asyncio.to_thread(engine.load)
    try:
        await _preempted_keeps_logprobs(engine)
    finally:
        await asyncio.to_thread(engine.unload)


async def _preempted_keeps_logprobs(engine: TransformersEngine) -> None:
    request = GenerationRequest(
        "pre", SamplingParams(max_tokens=16, temperature=0.9, seed=5), prompt="go", logprobs=1
    )
    ids, logprobs, _ = await generate(engine, request, preempt_after=4)
    assert engine.scheduling().preemptions == 1 and len(ids) == len(logprobs) == 16
    assert [item.token_id for item in logprobs] == ids
    assert all(math.isfinite(item.logprob) and item.logprob <= 0 for item in logprobs)
    uninterrupted, _, _ = await generate(
        engine, GenerationRequest("plain", request.params, prompt="go", logprobs=1)
    )
    assert uninterrupted == ids  # seeded: the same tokens, preempted or not
