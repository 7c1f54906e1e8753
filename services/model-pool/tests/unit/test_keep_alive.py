"""Keep-alive per model with per-category defaults: which value a model gets, and an idle LLM
unloaded after its category's keep-alive (a fake clock; the LLM's engine is a stand-in)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.common.config import CategoryKeepAliveSettings, ModelSettings, ModelsSettings
from loadmaster.model_pool.engines import Engine, engine_class
from loadmaster.model_pool.keep_alive import keep_alive_for
from loadmaster.model_pool.pool import ModelPool
from loadmaster.model_pool.repository import (
    CATEGORY_BY_BACKEND,
    ModelConfigError,
    ModelRepository,
    ModelSpec,
    parse_config,
)
from loadmaster.model_pool.slots import ModelState

DOUBLE = """
class Double:
    def infer(self, inputs):
        return {"y": inputs["x"] * 2}
"""


def spec(data: dict[str, Any], model_id: str = "m") -> ModelSpec:
    return parse_config(model_id, Path("/models") / model_id, data)


LLM = {"backend": "transformers"}
TENSOR = {"backend": "python", "class": "Double"}


def test_the_category_comes_from_the_config_else_from_the_backend() -> None:
    assert spec(LLM).category == "llm"
    assert spec(TENSOR).category == "other"
    assert spec({**TENSOR, "category": "vision"}).category == "vision"
    assert spec({**LLM, "category": "other"}).category == "other"
    assert CATEGORY_BY_BACKEND["openai_process"] == "llm"
    assert CATEGORY_BY_BACKEND["diffusers"] == "diffusion"
    with pytest.raises(ModelConfigError, match="category"):
        spec({**TENSOR, "category": "audio"})
    with pytest.raises(ModelConfigError, match="keep_alive_s"):
        spec({**TENSOR, "keep_alive_s": 0})


@pytest.mark.parametrize(
    ("config", "expected_s"),
    [
        (LLM, 300.0),
        ({**TENSOR, "category": "llm"}, 300.0),
        ({**TENSOR, "category": "vision"}, 60.0),
        ({**TENSOR, "category": "diffusion"}, 900.0),
        (TENSOR, None),  # other: never unloaded for idleness, as before
    ],
)
def test_the_default_keep_alive_per_category(config: dict[str, Any], expected_s: float | None) -> None:
    assert keep_alive_for(ModelsSettings(), spec(config)) == expected_s


def test_a_model_setting_beats_the_config_which_beats_the_category_which_beats_the_defaults() -> None:
    models = ModelsSettings(
        defaults=ModelSettings(keep_alive_s=7.0),
        known={"set": ModelSettings(keep_alive_s=11.0), "other": ModelSettings(max_inflight=3)},
        category_keep_alive_s=CategoryKeepAliveSettings(llm=5.0),
    )
    assert keep_alive_for(models, spec({**LLM, "keep_alive_s": 9.0}, "set")) == 11.0  # known
    assert keep_alive_for(models, spec({**LLM, "keep_alive_s": 9.0}, "other")) == 9.0  # config.yaml
    assert keep_alive_for(models, spec(LLM, "other")) == 5.0  # the category's
    assert keep_alive_for(models, spec(TENSOR, "other")) == 7.0  # other: none, so models.defaults
    never = ModelsSettings(category_keep_alive_s=CategoryKeepAliveSettings(llm=None))
    assert keep_alive_for(never, spec(LLM)) is None


class StandInLLM(Engine):
    """A `transformers`-backend model that loads nothing (the pool's lifecycle is under test)."""

    backend = "transformers"

    @classmethod
    def artifact_files(cls, spec: ModelSpec) -> Iterable[Path]:
        return ()

    def load(self) -> None:
        pass

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {}

    def unload(self) -> None:
        pass


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    (root / "chat").mkdir(parents=True)
    (root / "chat" / "config.yaml").write_text("backend: transformers\nvram_mb: 64\n")
    (root / "double").mkdir()
    (root / "double" / "config.yaml").write_text("backend: python\nclass: Double\nvram_mb: 16\n")
    (root / "double" / "model.py").write_text(DOUBLE)
    return root


async def until_idle(pool: ModelPool, model_id: str) -> None:
    for _ in range(100):  # bounded: 100 x 10 ms
        if pool.status(model_id).state is ModelState.IDLE:
            return
        await asyncio.sleep(0.01)


async def test_an_idle_llm_is_unloaded_after_its_category_keep_alive(repo: Path, leases: Any) -> None:
    clock = FakeClock()
    pool = ModelPool(
        ModelRepository(repo),
        models=ModelsSettings(category_keep_alive_s=CategoryKeepAliveSettings(llm=5.0)),
        lease_client=leases,
        clock=clock,
        engines=lambda backend: StandInLLM if backend == "transformers" else engine_class(backend),
    )
    try:
        await pool.load("chat")
        await pool.load("double")  # category other: no keep-alive
        clock.advance(4.9)
        await asyncio.sleep(0.05)
        assert pool.status("chat").state is ModelState.READY
        clock.advance(0.1)
        await until_idle(pool, "chat")
        assert pool.status("chat").state is ModelState.IDLE
        assert "evicted (idle)" in pool.status("chat").error
        assert pool.status("double").state is ModelState.READY
        assert pool.counters.by_reason() == {"idle": 1}
        assert len(leases.held) == 1  # the LLM's lease went back
        clock.advance(3600.0)
        await asyncio.sleep(0.05)
        assert pool.status("double").state is ModelState.READY
    finally:
        await pool.close()


async def test_a_request_restarts_the_idle_clock(repo: Path, leases: Any) -> None:
    clock = FakeClock()
    pool = ModelPool(
        ModelRepository(repo),
        models=ModelsSettings(category_keep_alive_s=CategoryKeepAliveSettings(llm=5.0, other=5.0)),
        lease_client=leases,
        clock=clock,
        engines=lambda backend: StandInLLM if backend == "transformers" else engine_class(backend),
    )
    try:
        await pool.load("double")
        clock.advance(4.0)
        await pool.infer("double", {"x": np.array([1.0], dtype=np.float32)})
        clock.advance(4.0)  # 8 s after the load, 4 s after the request
        await asyncio.sleep(0.05)
        assert pool.status("double").state is ModelState.READY
        clock.advance(1.0)
        await until_idle(pool, "double")
        assert pool.status("double").state is ModelState.IDLE
    finally:
        await pool.close()


async def test_pins_and_keep_alive_changed_at_run_time_apply_to_the_running_pool(
    repo: Path, leases: Any
) -> None:
    """`use_models` (the admin plane's runtime settings): a changed pin applies at once, a pin
    made through `pin()` stays while its setting does not change, a loaded model's keep-alive
    is read again."""
    clock = FakeClock()
    pool = ModelPool(
        ModelRepository(repo),
        models=ModelsSettings(),
        lease_client=leases,
        clock=clock,
        engines=lambda backend: StandInLLM if backend == "transformers" else engine_class(backend),
    )
    try:
        await pool.load("double")  # category other: never unloaded for idleness
        pool.pin("chat")
        pool.use_models(ModelsSettings(known={"double": ModelSettings(keep_alive_s=5.0, pin=True)}))
        assert pool.status("double").pinned and pool.status("chat").pinned
        pool.use_models(ModelsSettings(known={"double": ModelSettings(keep_alive_s=5.0)}))
        assert not pool.status("double").pinned and pool.status("chat").pinned
        clock.advance(5.0)
        await until_idle(pool, "double")
        assert pool.status("double").state is ModelState.IDLE  # the new keep-alive applied
    finally:
        await pool.close()
