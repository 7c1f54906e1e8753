"""The transformers engine on CPU with `tiny-chat` built in a temp folder (examples/make_models.py).

Real parts: the real tokenizer, the real model, transformers' own continuous-batching
manager and its background thread. Few tokens each, so the module runs in seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib.util
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from loadmaster.common.config import ModelsSettings
from loadmaster.common.errors import InvalidArgumentError, UnavailableError
from loadmaster.model_pool.engines import EngineContext, engine_class
from loadmaster.model_pool.engines.transformers import TransformersEngine, kv_bytes_per_token
from loadmaster.model_pool.generation import (
    ChatMessage,
    FinishReason,
    GenerationEnd,
    GenerationRequest,
    SamplingParams,
    TokenChunk,
)
from loadmaster.model_pool.generation_order import OrderPolicy
from loadmaster.model_pool.pool import ModelPool
from loadmaster.model_pool.repository import ModelRepository, TransformersModelConfig

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"


def load_make_models() -> Any:
    spec = importlib.util.spec_from_file_location("_lm_make_models_llm", EXAMPLES / "make_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "again", "and", "again")
PROMPTS = [f"request {i}: {word}" for i, word in enumerate(WORDS)]


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny") / "models"
    (root / "tiny-chat").mkdir(parents=True)
    shutil.copy(EXAMPLES / "models" / "tiny-chat" / "config.yaml", root / "tiny-chat" / "config.yaml")
    load_make_models().build(["tiny-chat"], root=root)
    return root


@pytest.fixture(scope="module")
def engine(tiny_repo: Path) -> Iterator[TransformersEngine]:
    spec = ModelRepository(tiny_repo).spec("tiny-chat")
    cls = engine_class("transformers")
    assert cls is TransformersEngine
    instance = TransformersEngine(spec, EngineContext(device="cpu", threads=1))
    instance.load()
    instance.warmup()
    yield instance
    instance.unload()


def request(request_id: str, *, prompt: str = "hello", **params: Any) -> GenerationRequest:
    params.setdefault("max_tokens", 8)
    params.setdefault("temperature", 0.0)
    return GenerationRequest(request_id, SamplingParams(**params), prompt=prompt)


async def collect(
    engine: TransformersEngine, req: GenerationRequest
) -> tuple[list[TokenChunk], GenerationEnd]:
    chunks: list[TokenChunk] = []
    end: GenerationEnd | None = None
    stream = await engine.submit(req)
    async with asyncio.timeout(60):
        async for event in stream:
            assert end is None, "an event after the terminal"
            if isinstance(event, GenerationEnd):
                end = event
            else:
                chunks.append(event)
    assert end is not None
    assert [c.sequence for c in chunks] == list(range(len(chunks)))  # in order, each once
    assert end.sequence == len(chunks)
    return chunks, end


def token_ids(chunks: list[TokenChunk]) -> list[int]:
    return [token for chunk in chunks for token in chunk.token_ids]


def reference_greedy(engine: TransformersEngine, prompt: str, max_tokens: int) -> list[int]:
    ids = engine._tokenizer.encode(prompt, add_special_tokens=True)
    with torch.inference_mode():
        out = engine._model.generate(
            torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
        )
    return [int(t) for t in out[0, len(ids) :]]


async def wait_idle(engine: TransformersEngine) -> None:
    for _ in range(300):  # bounded: 3 s
        stats = engine.stats()
        if stats.running == 0 and stats.waiting == 0 and stats.streams_open == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"sequences still held: {engine.stats()}")


# ---- the model folder -----------------------------------------------------------------


def test_tiny_chat_is_a_normal_hf_folder_built_reproducibly(tiny_repo: Path, tmp_path: Path) -> None:
    folder = tiny_repo / "tiny-chat" / "artifacts"
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        assert (folder / name).is_file(), name
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["model_type"]) == (2, 128, "llama")
    again = tmp_path / "models"
    load_make_models().build(["tiny-chat"], root=again)
    for name in ("model.safetensors", "tokenizer.json"):
        digest = [
            hashlib.sha256((root / "tiny-chat" / "artifacts" / name).read_bytes()).hexdigest()
            for root in (tiny_repo, again)
        ]
        assert digest[0] == digest[1], f"{name} differs between two builds"


def test_lease_estimate_is_weights_plus_kv_budget(tiny_repo: Path) -> None:
    spec = ModelRepository(tiny_repo).spec("tiny-chat")
    hf = json.loads((tiny_repo / "tiny-chat" / "artifacts" / "config.json").read_text())
    per_token = kv_bytes_per_token(hf, "auto")
    assert per_token == 2 * 2 * 2 * 32 * 4  # K+V, 2 layers, 2 kv heads, head_dim 32, float32
    weights = (tiny_repo / "tiny-chat" / "artifacts" / "model.safetensors").stat().st_size
    config = spec.config
    assert isinstance(config, TransformersModelConfig) and config.num_blocks is not None
    kv_mb = -(-config.num_blocks * config.block_size * per_token // (1 << 20))  # from config.yaml
    assert TransformersEngine.estimate_mb(spec) == -(-int(weights * 1.2) // (1 << 20)) + kv_mb


# ---- generation -----------------------------------------------------------------------


async def test_concurrent_streams_each_get_their_own_greedy_tokens(engine: TransformersEngine) -> None:
    results = await asyncio.gather(
        *(collect(engine, request(f"c{i}", prompt=p, max_tokens=6)) for i, p in enumerate(PROMPTS))
    )
    assert len(results) >= 8
    for prompt, (chunks, end) in zip(PROMPTS, results, strict=True):
        assert end.finish_reason is FinishReason.LENGTH
        assert end.usage.completion_tokens == 6
        assert token_ids(chunks) == reference_greedy(engine, prompt, 6), prompt
        assert "".join(c.text for c in chunks) == engine._tokenizer.decode(
            token_ids(chunks), skip_special_tokens=True
        )
    await wait_idle(engine)


async def test_greedy_equals_model_generate(engine: TransformersEngine) -> None:
    chunks, end = await collect(engine, request("g", prompt="Loadmaster serves", max_tokens=12))
    assert token_ids(chunks) == reference_greedy(engine, "Loadmaster serves", 12)
    assert end.usage.prompt_tokens == len(engine._tokenizer.encode("Loadmaster serves"))


async def test_stop_string_ends_the_stream_before_it(engine: TransformersEngine) -> None:
    chunks, _ = await collect(engine, request("full", prompt="a model", max_tokens=16))
    text = "".join(c.text for c in chunks)
    cut = next(
        i
        for i in range(len(text) // 3, len(text) - 3)
        if text[i : i + 3].strip() and text.find(text[i : i + 3]) == i
    )
    stop = text[cut : cut + 3]
    chunks, end = await collect(
        engine, request("stopped", prompt="a model", max_tokens=16, stop=(stop, "never-seen"))
    )
    assert end.finish_reason is FinishReason.STOP
    assert "".join(c.text for c in chunks) == text[:cut]
    assert end.usage.completion_tokens < 16
    await wait_idle(engine)  # the sequence was cancelled in the manager


async def test_cancel_ends_the_stream_and_frees_the_sequence(engine: TransformersEngine) -> None:
    stream = await engine.submit(request("long", max_tokens=2000))
    first = await asyncio.wait_for(stream.__anext__(), 30)
    assert isinstance(first, TokenChunk)
    busy = engine.stats()
    assert (busy.running, busy.streams_open) == (1, 1)
    assert 0 < busy.kv_blocks_used <= busy.kv_blocks_total == engine.spec.config.num_blocks  # type: ignore[attr-defined]
    assert engine.cancel("long") is True
    rest = [event async for event in stream]
    assert isinstance(rest[-1], GenerationEnd)
    assert rest[-1].finish_reason is FinishReason.CANCELLED
    assert rest[-1].usage.completion_tokens < 2000
    await wait_idle(engine)
    assert engine.cancel("long") is False


async def test_closing_a_stream_early_cancels_it(engine: TransformersEngine) -> None:
    async with await engine.submit(request("closed", max_tokens=2000)) as stream:
        await asyncio.wait_for(stream.__anext__(), 30)
    await wait_idle(engine)


async def test_seed_reproduces_a_sampled_reply_whatever_its_batch_mates(engine: TransformersEngine) -> None:
    alone, _ = await collect(engine, request("s1", temperature=1.0, seed=1234, max_tokens=10))
    crowd = await asyncio.gather(
        collect(engine, request("s2", temperature=1.0, seed=1234, max_tokens=10)),
        *(
            collect(engine, request(f"n{i}", prompt=p, temperature=1.0, max_tokens=10))
            for i, p in enumerate(PROMPTS[:6])
        ),
    )
    other, _ = await collect(engine, request("s3", temperature=1.0, seed=99, max_tokens=10))
    assert token_ids(crowd[0][0]) == token_ids(alone)
    assert token_ids(other) != token_ids(alone)


# ---- the scheduler inside the manager (engines/_cb_scheduler.py) ---------------------


@pytest.fixture
def small_engine(tiny_repo: Path, request: pytest.FixtureRequest) -> Iterator[TransformersEngine]:
    """tiny-chat with `max_sequences` places and an order policy (the test's param)."""
    sequences, policy, *resident = request.param
    spec = ModelRepository(tiny_repo).spec("tiny-chat")
    update = {"max_sequences": sequences, "max_resident_sequences": resident[0] if resident else sequences}
    config = spec.config.model_copy(update=update)
    spec = dataclasses.replace(spec, config=config)
    instance = TransformersEngine(spec, EngineContext(device="cpu", threads=1, order_policy=policy))
    instance.load()
    yield instance
    instance.unload()


def ranked(request_id: str, priority: int, *, tenant: str = "t", **params: Any) -> GenerationRequest:
    base = request(request_id, temperature=1.0, seed=7, **params)
    return dataclasses.replace(base, priority=priority, tenant=tenant)


async def first_tokens_in_order(engine: TransformersEngine, requests: list[GenerationRequest]) -> list[str]:
    """Submit all, one after another (so they arrive in this order), then the order in which
    their first tokens came."""
    order: list[str] = []
    streams = [await engine.submit(req) for req in requests]

    async def read(stream: Any) -> None:
        async for event in stream:
            if isinstance(event, TokenChunk) and stream.request_id not in order:
                order.append(stream.request_id)

    async with asyncio.timeout(60):
        await asyncio.gather(*(read(stream) for stream in streams))
    return order


@pytest.mark.parametrize("small_engine", [(2, OrderPolicy())], indirect=True)
async def test_a_priority_0_request_pauses_a_lower_one_which_keeps_its_cache_and_its_tokens(
    small_engine: TransformersEngine,
) -> None:
    engine = small_engine
    whole, _ = await collect(engine, ranked("whole", 2, max_tokens=120))
    low = [await engine.submit(ranked(name, 2, max_tokens=120)) for name in ("low-old", "low-new")]
    for stream in low:  # both are running
        await asyncio.wait_for(stream.__anext__(), 30)
    _, end = await collect(engine, ranked("urgent", 0, max_tokens=8))
    assert end.usage.completion_tokens == 8
    scheduling = engine.scheduling()
    assert scheduling.preemptions >= 1 and scheduling.kv_recomputed == 0 and scheduling.urgent_steps >= 1
    results = []
    for stream in low:
        async with asyncio.timeout(60):
            results.append([event async for event in stream])
    for events in results:  # neither finished before the urgent one; none lost or repeated a token
        assert isinstance(events[-1], GenerationEnd) and events[-1].usage.completion_tokens == 120
    # the paused one went on exactly where it stopped: its tokens are the uninterrupted run's
    # (the first chunk was read above, so compare from the second token on)
    assert token_ids([e for e in results[1] if isinstance(e, TokenChunk)]) == token_ids(whole)[-119:]
    assert engine.scheduling().resumes >= 1


@pytest.mark.parametrize("small_engine", [(8, OrderPolicy())], indirect=True)
async def test_while_urgent_work_runs_a_step_carries_few_lower_priority_sequences(
    small_engine: TransformersEngine,
) -> None:
    """With 8 places, a step carries at most 2 (a quarter) lower-priority sequences while a
    priority-0 one runs: the step an urgent request waits for stays short."""
    engine = small_engine
    low = [await engine.submit(ranked(f"low-{i}", 2, max_tokens=400)) for i in range(8)]
    for stream in low:
        await asyncio.wait_for(stream.__anext__(), 30)
    urgent = await engine.submit(ranked("urgent", 0, tenant="u", max_tokens=40))
    first_seen: int | None = None
    end: GenerationEnd | None = None
    async with asyncio.timeout(60):
        async for event in urgent:
            if first_seen is None:  # from its first token on, the steps are capped
                first_seen = engine.scheduling().output_tokens["t"]
            if isinstance(event, GenerationEnd):
                end = event
    lower_tokens = engine.scheduling().output_tokens["t"] - (first_seen or 0)
    assert end is not None and end.usage.completion_tokens == 40
    # its 39 more steps carry at most 2 lower sequences each, plus the step in flight (8) and
    # one more after it ended (the snapshot is read at the next step)
    assert lower_tokens <= 2 * 39 + 8 + 2, lower_tokens
    for stream in low:
        await stream.aclose()


@pytest.mark.parametrize("small_engine", [(1, OrderPolicy(timeslice_tokens=4))], indirect=True)
async def test_with_timeslices_lower_priority_work_yields_to_better_work_and_resumes(
    small_engine: TransformersEngine,
) -> None:
    engine = small_engine
    whole, _ = await collect(engine, ranked("whole", 3, max_tokens=60))
    low = await engine.submit(ranked("low", 3, max_tokens=60))
    await asyncio.wait_for(low.__anext__(), 30)
    await collect(engine, ranked("better", 1, max_tokens=6))  # priority 1: only a slice lets it in
    assert engine.scheduling().yields >= 1
    async with asyncio.timeout(60):
        rest = [event async for event in low]
    assert isinstance(rest[-1], GenerationEnd) and rest[-1].usage.completion_tokens == 60
    assert token_ids([e for e in rest if isinstance(e, TokenChunk)]) == token_ids(whole)[-59:]
    assert engine.scheduling().resumes >= 1


@pytest.mark.parametrize("small_engine", [(1, OrderPolicy())], indirect=True)
async def test_with_one_place_the_tenant_served_least_goes_next(small_engine: TransformersEngine) -> None:
    engine = small_engine
    hog = await engine.submit(ranked("hog", 1, tenant="a", max_tokens=30))
    await asyncio.wait_for(hog.__anext__(), 30)  # tenant a is being served
    queued = [ranked(f"a{i}", 1, tenant="a", max_tokens=2) for i in range(3)] + [
        ranked("b0", 1, tenant="b", max_tokens=2)
    ]
    order = await first_tokens_in_order(engine, queued)
    assert order.index("b0") == 0, order  # b arrived last but was served least
    snapshot = engine.scheduling()
    assert snapshot.output_tokens["a"] > snapshot.output_tokens["b"] > 0


@pytest.mark.parametrize("small_engine", [(2, OrderPolicy(), 4)], indirect=True)
async def test_resident_sequences_share_the_steps_by_their_tenants_weights(
    small_engine: TransformersEngine,
) -> None:
    """4 sequences hold their cache, 2 run per step: each place goes to the tenant whose
    weighted counter is lowest, so the weight-2 tenant gets about two thirds of the tokens."""
    engine = small_engine
    streams = [
        await engine.submit(
            dataclasses.replace(
                ranked(f"{tenant}-{i}", 1, tenant=tenant, max_tokens=600), tenant_weight=weight
            )
        )
        for tenant, weight in (("heavy", 2.0), ("light", 1.0))
        for i in range(2)
    ]
    for stream in streams:
        await asyncio.wait_for(stream.__anext__(), 30)
    start = engine.scheduling().output_tokens
    for _ in range(300):  # bounded: 3 s, until 200 more tokens were made
        now = engine.scheduling().output_tokens
        if sum(now.values()) - sum(start.values()) >= 200:
            break
        await asyncio.sleep(0.01)
    heavy = now["heavy"] - start["heavy"]
    light = now["light"] - start["light"]
    assert 1.5 <= heavy / max(1, light) <= 2.5, (heavy, light)
    for stream in streams:
        await stream.aclose()


@pytest.mark.parametrize("small_engine", [(1, OrderPolicy(fairness=False))], indirect=True)
async def test_with_fairness_off_the_same_workload_is_served_in_arrival_order(
    small_engine: TransformersEngine,
) -> None:
    engine = small_engine
    hog = await engine.submit(ranked("hog", 1, tenant="a", max_tokens=30))
    await asyncio.wait_for(hog.__anext__(), 30)
    queued = [ranked(f"a{i}", 1, tenant="a", max_tokens=2) for i in range(3)] + [
        ranked("b0", 1, tenant="b", max_tokens=2)
    ]
    assert await first_tokens_in_order(engine, queued) == ["a0", "a1", "a2", "b0"]


async def test_chat_messages_use_the_chat_template(engine: TransformersEngine) -> None:
    messages = (ChatMessage("system", "be brief"), ChatMessage("user", "hello"))
    stream = await engine.submit(
        GenerationRequest("chat", SamplingParams(max_tokens=3, temperature=0.0), messages=messages)
    )
    expected = engine._tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True, tokenize=False
    )
    assert expected.endswith("<|assistant|>")
    assert stream.prompt_tokens == len(engine._tokenizer.encode(expected, add_special_tokens=False))
    events = [event async for event in stream]
    assert isinstance(events[-1], GenerationEnd) and events[-1].usage.completion_tokens == 3


@pytest.mark.parametrize(
    ("req", "field"),
    [
        (request("b1", max_tokens=0), "max_tokens"),
        (request("b2", temperature=2.5), "temperature"),
        (request("b3", top_p=0.0), "top_p"),
        (request("b4", stop=("a", "b", "c", "d", "e")), "stop"),
        (request("b5", stop=("",)), "stop[0]"),
        (request("b6", max_tokens=100_000), "context"),
        (GenerationRequest("b7", SamplingParams(max_tokens=2), messages=()), "messages"),
        (
            GenerationRequest("b8", SamplingParams(max_tokens=2), messages=(ChatMessage("robot", "x"),)),
            "messages[0].role",
        ),
        (
            GenerationRequest("b9", SamplingParams(max_tokens=2), prompt_token_ids=(1, 99_999)),
            "prompt_token_ids[1]",
        ),
        (
            GenerationRequest("b10", SamplingParams(max_tokens=2), prompt="x", prompt_token_ids=(1,)),
            "exactly one",
        ),
    ],
)
async def test_bad_input_is_refused_naming_the_field(
    engine: TransformersEngine, req: GenerationRequest, field: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=field.replace("[", r"\[").replace("]", r"\]")):
        await engine.submit(req)
    _, end = await collect(engine, request("after-bad", max_tokens=2))  # still serving
    assert end.finish_reason is FinishReason.LENGTH


async def test_duplicate_request_id_is_refused(engine: TransformersEngine) -> None:
    stream = await engine.submit(request("dup", max_tokens=2000))
    with pytest.raises(InvalidArgumentError, match="already generating"):
        await engine.submit(request("dup"))
    await stream.aclose()
    await wait_idle(engine)
    # Two at once (both pass the first check while their prompts are tokenised): one wins.
    outcomes = await asyncio.gather(
        engine.submit(request("twin", max_tokens=2000)),
        engine.submit(request("twin", max_tokens=2000)),
        return_exceptions=True,
    )
    streams = [o for o in outcomes if not isinstance(o, BaseException)]
    errors = [o for o in outcomes if isinstance(o, InvalidArgumentError)]
    assert (len(streams), len(errors)) == (1, 1)
    await streams[0].aclose()
    await wait_idle(engine)


def test_tensor_requests_are_refused(engine: TransformersEngine) -> None:
    with pytest.raises(InvalidArgumentError, match="generative"):
        engine.infer({})


# ---- in the pool: lease, lifecycle ---------------------------------------------------


async def test_pool_leases_loads_and_unloads_it_like_any_engine(tiny_repo: Path, leases: Any) -> None:
    pool = ModelPool(
        ModelRepository(tiny_repo), models=ModelsSettings(), lease_client=leases, lease_ttl_s=5.0
    )
    try:
        status = await pool.load("tiny-chat")
        assert status.backend == "transformers"
        spec = ModelRepository(tiny_repo).spec("tiny-chat")
        assert leases.acquired[-1]["mb"] == TransformersEngine.estimate_mb(spec)
        loaded = pool._loaded["tiny-chat"].instances[0].engine
        assert isinstance(loaded, TransformersEngine)
        _, end = await collect(loaded, request("in-pool", max_tokens=3))
        assert end.finish_reason is FinishReason.LENGTH
        open_stream = await loaded.submit(request("open", max_tokens=2000))
        await pool.unload("tiny-chat")
        events = [event async for event in open_stream]
        assert isinstance(events[-1], GenerationEnd) and events[-1].finish_reason is FinishReason.ERROR
        assert leases.released == [leases.acquired[-1]["lease_id"]]
        with pytest.raises(UnavailableError):
            await loaded.submit(request("late"))
    finally:
        await pool.close()
