"""`n` choices from one prompt in the transformers engine (tiny-chat, CPU): the prompt is
prefilled once and forked by transformers' manager; each choice has its own seed (choice 0
is the n=1 reply); grammars, log probabilities, cancel and preemption hold per choice."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.model_pool.engines import EngineContext
from loadmaster.model_pool.engines.transformers import TransformersEngine
from loadmaster.model_pool.generation import (
    FinishReason,
    GenerationEnd,
    GenerationRequest,
    ResponseFormat,
    SamplingParams,
    TokenChunk,
)
from loadmaster.model_pool.repository import ModelRepository

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
PROMPT = "a prompt of a few more tokens than one"


@pytest.fixture(scope="module")
def engine() -> Iterator[TransformersEngine]:
    instance = TransformersEngine(
        ModelRepository(EXAMPLES / "models").spec("tiny-chat"), EngineContext(device="cpu", threads=1)
    )
    instance.load()
    instance.warmup()  # the manager builds its batch processor (and cache) on its first step
    yield instance
    instance.unload()


@pytest.fixture(scope="module")
def two_places() -> Iterator[TransformersEngine]:
    """tiny-chat with 2 places: a request of n=2 fills it, so an urgent one pauses a choice."""
    spec = ModelRepository(EXAMPLES / "models").spec("tiny-chat")
    config = spec.config.model_copy(update={"max_sequences": 2, "max_resident_sequences": 2})
    instance = TransformersEngine(
        dataclasses.replace(spec, config=config), EngineContext(device="cpu", threads=1)
    )
    instance.load()
    yield instance
    instance.unload()


async def urgent_turn(engine: TransformersEngine) -> None:
    """A priority-0 request, run to its end: on a full engine it pauses a running sequence."""
    urgent = dataclasses.replace(request(f"urgent-{id(engine)}", max_tokens=4), priority=0)
    async for _ in await engine.submit(urgent):
        pass


def request(request_id: str, *, n: int = 1, **fields: Any) -> GenerationRequest:
    params = SamplingParams(
        max_tokens=fields.pop("max_tokens", 8), temperature=1.0, seed=fields.pop("seed", 9)
    )
    return GenerationRequest(request_id, params, prompt=PROMPT, n=n, **fields)


async def choices(
    engine: TransformersEngine, req: GenerationRequest, *, preempt_after: int = 0
) -> tuple[dict[int, list[TokenChunk]], GenerationEnd]:
    out: dict[int, list[TokenChunk]] = {}
    sequences = []
    async with asyncio.timeout(60):
        async for event in await engine.submit(req):
            sequences.append(event.sequence)
            if isinstance(event, GenerationEnd):
                assert sequences == list(range(len(sequences)))  # one stream, one numbering
                return out, event
            out.setdefault(event.choice, []).append(event)
            if preempt_after and sum(len(c.token_ids) for c in out.get(0, [])) >= preempt_after:
                preempt_after = 0
                await urgent_turn(engine)
    raise AssertionError("no terminal")


def ids(chunks: list[TokenChunk]) -> list[int]:
    return [token for chunk in chunks for token in chunk.token_ids]


async def test_n_choices_are_forked_from_one_prefill_and_seeded_apart(engine: TransformersEngine) -> None:
    cache = engine._manager.batch_processor.cache
    forks: list[int] = []
    fork = cache.prepare_fork_request

    def counted(state: Any, new_ids: list[str], *args: Any) -> list[str]:
        forked = fork(state, new_ids, *args)
        forks.append(len(forked))
        return forked

    cache.prepare_fork_request = counted
    try:
        got, end = await choices(engine, request("three", n=3))
    finally:
        cache.prepare_fork_request = fork
    assert forks == [2]  # one prefill, two forks sharing its pages
    assert sorted(got) == [0, 1, 2] and len({tuple(ids(c)) for c in got.values()}) == 3
    assert [e.index for e in end.choices] == [0, 1, 2]
    for choice_end in end.choices:  # a choice may draw end-of-sequence before 8 tokens
        assert choice_end.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        assert choice_end.completion_tokens == len(ids(got[choice_end.index])) <= 8
    assert end.usage.completion_tokens == sum(len(ids(c)) for c in got.values())
    single, _ = await choices(engine, request("one"))
    assert ids(single[0]) == ids(got[0])  # choice 0 is what n=1 draws
    again, _ = await choices(engine, request("three-again", n=3))
    assert {c: ids(v) for c, v in again.items()} == {c: ids(v) for c, v in got.items()}  # seeded


async def test_each_choice_keeps_its_grammar_and_log_probabilities(engine: TransformersEngine) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a"],
        "additionalProperties": False,
    }
    got, end = await choices(
        engine,
        request(
            "json",
            n=4,
            max_tokens=60,
            logprobs=2,
            response_format=ResponseFormat(kind="json_schema", schema=json.dumps(schema)),
        ),
    )
    assert [e.finish_reason for e in end.choices] == [FinishReason.STOP] * 4
    for chunks in got.values():
        value = json.loads("".join(c.text for c in chunks))
        assert set(value) == {"a"} and 0 <= value["a"] <= 99
        logprobs = [item for c in chunks for item in c.logprobs]
        assert [item.token_id for item in logprobs] == ids(chunks) and all(len(i.top) == 2 for i in logprobs)


async def test_cancel_ends_every_choice_with_one_terminal(engine: TransformersEngine) -> None:
    stream = await engine.submit(request("cancelled", n=3, max_tokens=500))
    first = await anext(stream)
    assert isinstance(first, TokenChunk)
    assert engine.cancel("cancelled")
    events = [event async for event in stream]
    ends = [event for event in events if isinstance(event, GenerationEnd)]
    assert len(ends) == 1 and ends[0].finish_reason is FinishReason.CANCELLED and events[-1] is ends[0]
    assert engine.stats().streams_open == 0 and not engine.cancel("cancelled")


async def test_a_preempted_request_resumes_every_choice_where_it_was(two_places: TransformersEngine) -> None:
    engine = two_places
    plain, _ = await choices(engine, request("plain", n=2, max_tokens=16, seed=4))
    before = engine.scheduling().preemptions
    preempted, _ = await choices(engine, request("preempted", n=2, max_tokens=16, seed=4), preempt_after=3)
    assert engine.scheduling().preemptions == before + 1
    assert {c: ids(v) for c, v in preempted.items()} == {c: ids(v) for c, v in plain.items()}


async def test_more_choices_than_the_model_runs_at_once_are_refused(engine: TransformersEngine) -> None:
    with pytest.raises(InvalidArgumentError, match=r"^n: 33 choices"):
        await engine.submit(request("many", n=33))
