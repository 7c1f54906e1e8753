"""Per-model chat templates and the thinking switch (engines/_chat_templates.py), on CPU with
`tiny-think` built in a temp folder (examples/make_models.py): tiny-chat's weights and tokenizer
in a folder without a chat template, whose config.yaml names one that reads `enable_thinking`."""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.model_pool.engines import EngineContext
from loadmaster.model_pool.engines._chat_templates import chat_template, template_kwargs
from loadmaster.model_pool.engines.transformers import TransformersEngine
from loadmaster.model_pool.generation import ChatMessage, GenerationEnd, GenerationRequest, SamplingParams
from loadmaster.model_pool.repository import ModelConfigError, ModelRepository, TransformersModelConfig

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
MESSAGES = (ChatMessage("user", "hello"),)
THINK_OFF = "<s><|user|>hello</s><|assistant|><think>\n\n</think>\n\n"
THINK_ON = "<s><|user|>hello</s><|assistant|>"


def _make_models() -> Any:
    spec = importlib.util.spec_from_file_location("_lm_make_models_think", EXAMPLES / "make_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def think_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("think") / "models"
    shutil.copytree(
        EXAMPLES / "models" / "tiny-think", root / "tiny-think", ignore=shutil.ignore_patterns("artifacts")
    )
    _make_models().build(["tiny-think"], root=root)
    assert not (root / "tiny-think" / "artifacts" / "chat_template.jinja").exists()  # the folder has none
    return root


def _engine(repo: Path, model_id: str) -> TransformersEngine:
    engine = TransformersEngine(ModelRepository(repo).spec(model_id), EngineContext(device="cpu", threads=1))
    engine.load()
    return engine


@pytest.fixture(scope="module")
def engine(think_repo: Path) -> Iterator[TransformersEngine]:
    instance = _engine(think_repo, "tiny-think")
    yield instance
    instance.unload()


def chat(request_id: str, **kwargs: Any) -> GenerationRequest:
    return GenerationRequest(
        request_id,
        SamplingParams(max_tokens=3, temperature=0.0),
        messages=MESSAGES,
        chat_template_kwargs=kwargs or None,
    )


async def prompt_tokens(engine: TransformersEngine, request: GenerationRequest) -> int:
    stream = await engine.submit(request)
    async with asyncio.timeout(60):
        events = [event async for event in stream]
    assert isinstance(events[-1], GenerationEnd) and events[-1].usage.completion_tokens == 3
    return events[-1].usage.prompt_tokens


def tokens(engine: TransformersEngine, text: str) -> int:
    return len(engine._tokenizer.encode(text, add_special_tokens=False))


async def test_the_configs_template_renders_with_its_thinking_default_and_a_request_overrides_it(
    engine: TransformersEngine,
) -> None:
    off = await prompt_tokens(engine, chat("default"))  # config.yaml: thinking: false
    assert off == tokens(engine, THINK_OFF)
    on = await prompt_tokens(engine, chat("on", enable_thinking=True))
    assert on == tokens(engine, THINK_ON) and on < off
    assert await prompt_tokens(engine, chat("off", enable_thinking=False)) == off


async def test_reserved_template_arguments_are_refused_naming_them(engine: TransformersEngine) -> None:
    with pytest.raises(InvalidArgumentError, match=r"chat_template_kwargs\.add_generation_prompt"):
        await engine.submit(chat("bad", add_generation_prompt=False))
    with pytest.raises(InvalidArgumentError, match="only chat messages"):
        GenerationRequest(
            "text", SamplingParams(max_tokens=1), prompt="x", chat_template_kwargs={"enable_thinking": True}
        ).check()


async def test_without_a_template_in_its_config_the_folder_has_none(think_repo: Path) -> None:
    folder = think_repo / "bare"
    folder.mkdir(exist_ok=True)
    (folder / "config.yaml").write_text(
        "backend: transformers\npath: artifacts\nnum_blocks: 16\nblock_size: 64\n"
    )
    shutil.copytree(think_repo / "tiny-think" / "artifacts", folder / "artifacts", dirs_exist_ok=True)
    bare = _engine(think_repo, "bare")
    try:
        with pytest.raises(InvalidArgumentError, match="has no chat template"):
            await bare.submit(chat("bare"))
    finally:
        bare.unload()


def test_a_template_is_a_file_of_the_model_folder_or_inline(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "t.jinja").write_text("{{ messages[0]['content'] }}")

    def spec(template: str) -> Any:
        (folder / "config.yaml").write_text(f"backend: transformers\nchat_template: {template!r}\n")
        return ModelRepository(tmp_path).spec("m")

    assert chat_template(spec("t.jinja")) == "{{ messages[0]['content'] }}"
    assert chat_template(spec("{% for m in messages %}{{ m.content }}{% endfor %}")) == (
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    with pytest.raises(ModelConfigError, match=r"chat_template: cannot read .*missing\.jinja"):
        chat_template(spec("missing.jinja"))
    with pytest.raises(ModelConfigError, match="points outside its folder"):
        chat_template(spec("../elsewhere.jinja"))
    config = TransformersModelConfig(backend="transformers", thinking=True)
    assert template_kwargs(config, chat("x")) == {"enable_thinking": True}
    assert template_kwargs(config, chat("x", enable_thinking=False, style="terse")) == {
        "enable_thinking": False,
        "style": "terse",
    }
    assert template_kwargs(TransformersModelConfig(backend="transformers"), chat("x")) == {}
