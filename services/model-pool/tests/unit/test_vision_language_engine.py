"""The vision-language engine on CPU with `tiny-vlm` built in a temp folder (examples/make_models.py).

Real parts: transformers' own LLaVA classes and processor, real PNG images, the engine's own
decoding thread. Few tokens each, so the module runs in seconds."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.model_pool.engines import EngineContext, engine_class
from loadmaster.model_pool.engines.vision_language import VisionLanguageEngine, sample_token
from loadmaster.model_pool.generation import (
    ChatMessage,
    FinishReason,
    GenerationEnd,
    GenerationRequest,
    ResponseFormat,
    SamplingParams,
    TokenChunk,
)
from loadmaster.model_pool.repository import ModelRepository

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"


def load_make_models() -> Any:
    spec = importlib.util.spec_from_file_location("_lm_make_models_vlm", EXAMPLES / "make_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VisionLanguageEngine]:
    root = tmp_path_factory.mktemp("vlm") / "models"
    (root / "tiny-vlm").mkdir(parents=True)
    shutil.copy(EXAMPLES / "models" / "tiny-vlm" / "config.yaml", root / "tiny-vlm" / "config.yaml")
    load_make_models().build(["tiny-vlm"], root=root)
    spec = ModelRepository(root).spec("tiny-vlm")
    assert engine_class("transformers_vlm") is VisionLanguageEngine
    instance = VisionLanguageEngine(spec, EngineContext(device="cpu", threads=1))
    instance.load()
    instance.warmup()
    yield instance
    instance.unload()


def png(seed: int) -> bytes:
    pixels = (np.random.default_rng(seed).random((40, 48, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def big_png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (5000, 4000)).save(out, format="PNG")  # 20 M pixels: over the 16.7 M default
    return out.getvalue()


def chat(request_id: str, *images: bytes, text: str = "what is it?", **params: Any) -> GenerationRequest:
    params.setdefault("max_tokens", 6)
    params.setdefault("temperature", 0.0)
    return GenerationRequest(
        request_id, SamplingParams(**params), messages=(ChatMessage("user", text, images=tuple(images)),)
    )


async def collect(engine: VisionLanguageEngine, request: GenerationRequest) -> tuple[str, GenerationEnd]:
    stream = await engine.submit(request)
    parts: list[str] = []
    async for event in stream:
        if isinstance(event, TokenChunk):
            parts.append(event.text)
        else:
            return "".join(parts), event
    raise AssertionError("no terminal event")


async def test_an_image_reaches_the_model_and_changes_its_answer(engine: VisionLanguageEngine) -> None:
    (one, end_one), (again, _), (other, _), (none, end_none) = await asyncio.gather(
        collect(engine, chat("a", png(1))),
        collect(engine, chat("b", png(1))),
        collect(engine, chat("c", png(2))),
        collect(engine, chat("d")),
    )
    assert end_one.finish_reason is FinishReason.LENGTH and end_one.usage.completion_tokens == 6
    assert end_one.usage.prompt_tokens == end_none.usage.prompt_tokens + 16  # 16 image tokens
    assert one == again  # greedy: the same image, the same answer, interleaved or not
    assert one != other or one != none  # the pixels reach the logits


async def test_two_images_take_two_sets_of_image_tokens(engine: VisionLanguageEngine) -> None:
    _, one = await collect(engine, chat("i1", png(3)))
    _, two = await collect(engine, chat("i2", png(3), png(4)))
    assert two.usage.prompt_tokens == one.usage.prompt_tokens + 16


async def test_a_seed_makes_a_sampled_reply_reproducible(engine: VisionLanguageEngine) -> None:
    first, second, third = await asyncio.gather(
        collect(engine, chat("s1", png(5), temperature=1.0, seed=11, max_tokens=8)),
        collect(engine, chat("s2", png(5), temperature=1.0, seed=11, max_tokens=8)),
        collect(engine, chat("s3", png(5), temperature=1.0, seed=12, max_tokens=8)),
    )
    assert first[0] == second[0] and first[0] != third[0]


async def test_cancel_preempt_and_resume(engine: VisionLanguageEngine) -> None:
    stream = await engine.submit(chat("x", png(6), max_tokens=200))
    assert engine.preempt("x") and not engine.preempt("x")
    assert engine.stats().waiting == 1
    assert engine.resume("x")
    first = await anext(stream)
    assert isinstance(first, TokenChunk)
    assert engine.cancel("x")
    rest = [event async for event in stream]
    assert isinstance(rest[-1], GenerationEnd) and rest[-1].finish_reason is FinishReason.CANCELLED
    assert not engine.cancel("x")
    greedy_whole, _ = await collect(engine, chat("w", png(7), max_tokens=10))
    paused = await engine.submit(chat("p", png(7), max_tokens=10))
    engine.preempt("p")
    await asyncio.sleep(0.05)
    engine.resume("p")
    text = "".join([e.text async for e in paused if isinstance(e, TokenChunk)])
    assert text == greedy_whole  # a resumed sequence neither loses nor repeats a token


async def test_stop_strings_end_the_reply(engine: VisionLanguageEngine) -> None:
    whole, _ = await collect(engine, chat("t1", png(8), max_tokens=12))
    stop = whole[3:5]
    cut, end = await collect(engine, chat("t2", png(8), max_tokens=12, stop=(stop,)))
    assert end.finish_reason is FinishReason.STOP and cut == whole[: whole.index(stop)]


@pytest.mark.parametrize(
    ("request_", "needle"),
    [
        (chat("r1", b"\x89PNG\r\n\x1a\nbroken"), "could not be decoded"),
        (chat("r2", big_png()), "exceeds the limit"),
        (chat("r3", *[png(1)] * 9), "at most 8"),
        (
            GenerationRequest(
                "r4",
                SamplingParams(max_tokens=4),
                messages=(ChatMessage("user", "x"),),
                response_format=ResponseFormat("json_object"),
            ),
            "response_format: model 'tiny-vlm' .* does not support it",
        ),
        (
            GenerationRequest("r6", SamplingParams(max_tokens=4), messages=(ChatMessage("user", "x"),), n=2),
            "n: model 'tiny-vlm'",
        ),
        (
            GenerationRequest(
                "r7", SamplingParams(max_tokens=4), messages=(ChatMessage("user", "x"),), logprobs=2
            ),
            "logprobs: model 'tiny-vlm'",
        ),
        (chat("r5", max_tokens=4000), "exceeds the context"),
    ],
)
async def test_bad_requests_are_refused_naming_why(
    engine: VisionLanguageEngine, request_: GenerationRequest, needle: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=needle):
        await engine.submit(request_)
    assert engine.stats().streams_open == 0


def test_sampling() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    generator = torch.Generator().manual_seed(0)
    assert sample_token(logits, SamplingParams(max_tokens=1, temperature=0.0), generator) == 1
    nucleus = {sample_token(logits, SamplingParams(max_tokens=1, top_p=0.5), generator) for _ in range(50)}
    assert nucleus <= {1, 3} and nucleus == {1, 3}


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here: the GPU path of transformers_vlm"
)
async def test_the_engine_runs_on_a_gpu(tmp_path: Path) -> None:
    root = tmp_path / "models"
    (root / "tiny-vlm").mkdir(parents=True)
    shutil.copy(EXAMPLES / "models" / "tiny-vlm" / "config.yaml", root / "tiny-vlm" / "config.yaml")
    load_make_models().build(["tiny-vlm"], root=root)
    gpu = VisionLanguageEngine(
        ModelRepository(root).spec("tiny-vlm"), EngineContext(device="cuda:0", threads=1)
    )
    gpu.load()
    try:
        text, end = await collect(gpu, chat("g", png(1)))
        assert end.finish_reason is FinishReason.LENGTH and end.usage.prompt_tokens > 16 and text
    finally:
        gpu.unload()
