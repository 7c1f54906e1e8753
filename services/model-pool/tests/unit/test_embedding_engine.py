"""The embedding engine with the example `tiny-embed` (a random BERT): vectors against the
model's own mean pooling, text and token ids alike, batch rows independent of their mates,
shorter `dimensions`, and the inputs it refuses by name."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.model_pool.engines import EngineContext, engine_class
from loadmaster.model_pool.engines.embedding import EmbeddingEngine
from loadmaster.model_pool.repository import ModelRepository

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"


@pytest.fixture(scope="module")
def engine() -> Iterator[EmbeddingEngine]:
    spec = ModelRepository(EXAMPLES / "models").spec("tiny-embed")
    assert engine_class(spec.backend) is EmbeddingEngine
    instance = EmbeddingEngine(spec, EngineContext(device="cpu", threads=1))
    instance.load()
    instance.warmup()
    yield instance
    instance.unload()


def inputs(
    texts: list[str], *, ids: list[list[int]] | None = None, dims: list[int] | None = None
) -> dict[str, np.ndarray]:
    rows = len(texts)
    packed = [np.asarray(row, "<u4").tobytes() for row in ids] if ids is not None else [b""] * rows
    return {
        "text": np.array([t.encode() for t in texts], dtype=object),
        "token_ids": np.array(packed, dtype=object),
        "dimensions": np.array(dims or [0] * rows, dtype=np.int32),
    }


def test_vectors_are_the_models_mean_pooled_states_at_unit_length(engine: EmbeddingEngine) -> None:
    out = engine.infer(inputs(["hello world", "a longer input about gateways and workers"]))
    vectors, tokens = out["embedding"], out["tokens"]
    assert vectors.shape == (2, 64) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    ids = engine._tokenizer.encode("hello world", add_special_tokens=True)
    assert tokens.tolist()[0] == len(ids)
    with torch.inference_mode():
        states = engine._model(input_ids=torch.tensor([ids])).last_hidden_state[0].mean(dim=0).numpy()
    assert np.allclose(vectors[0], states / np.linalg.norm(states), atol=1e-5)


def test_token_ids_embed_as_their_text_and_rows_do_not_depend_on_their_batch(engine: EmbeddingEngine) -> None:
    alone = engine.infer(inputs(["short"]))["embedding"][0]
    batched = engine.infer(inputs(["short", "a much longer neighbour that pads the batch " * 3]))[
        "embedding"
    ][0]
    assert np.allclose(alone, batched, atol=1e-5)
    ids = engine._tokenizer.encode("short", add_special_tokens=True)
    by_ids = engine.infer(inputs([""], ids=[ids]))["embedding"][0]
    assert np.allclose(alone, by_ids, atol=1e-6)


def test_shorter_dimensions_are_the_first_components_renormalised(engine: EmbeddingEngine) -> None:
    out = engine.infer(inputs(["hello", "hello"], dims=[16, 0]))["embedding"]
    short, full = out[0], out[1]
    assert np.count_nonzero(short[16:]) == 0 and np.isclose(np.linalg.norm(short[:16]), 1.0, atol=1e-5)
    expected = full[:16] / np.linalg.norm(full[:16])
    assert np.allclose(short[:16], expected, atol=1e-5)


@pytest.mark.parametrize(
    ("batch", "words"),
    [
        (inputs([""]), "input[0]: empty"),
        (inputs(["x"], dims=[8]), "dimensions: 8 is not a size"),
        (inputs([""], ids=[[5, 99999]]), "token id 99999 is outside the vocabulary"),
        (inputs(["word " * 600]), "tokens, model 'tiny-embed' takes at most 512"),
    ],
)
def test_bad_inputs_are_refused_naming_them(
    engine: EmbeddingEngine, batch: dict[str, np.ndarray], words: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(words)):
        engine.infer(batch)
