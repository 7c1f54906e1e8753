"""The remote_openai backend's config and key file (the running engine: tests/integration)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadmaster.model_pool.engines import engine_class
from loadmaster.model_pool.engines.remote_openai import RemoteOpenAIEngine, read_api_key
from loadmaster.model_pool.repository import (
    ModelConfigError,
    ModelRepository,
    ModelSpec,
    RemoteOpenAIModelConfig,
)

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
BASE = "backend: remote_openai\nbase_url: https://api.example.com/v1/\nremote_model: big-7b\n"


def spec(root: Path, config: str, **files: str) -> ModelSpec:
    folder = root / "cloud"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(config)
    for name, text in files.items():
        (folder / name).write_text(text)
    return ModelRepository(root).spec("cloud")


def test_a_remote_model_needs_no_memory_and_its_url_is_the_sdks(tmp_path: Path) -> None:
    model = spec(tmp_path, BASE)
    assert isinstance(model.config, RemoteOpenAIModelConfig)
    assert model.config.base_url == "https://api.example.com/v1"  # the trailing slash goes
    assert model.category == "llm"
    assert engine_class("remote_openai") is RemoteOpenAIEngine
    assert not RemoteOpenAIEngine.leases_memory and RemoteOpenAIEngine.estimate_mb(model) == 0
    example = ModelRepository(EXAMPLES / "models").spec("remote-chat")
    assert isinstance(example.config, RemoteOpenAIModelConfig) and example.config.api_key_file is None


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ("vram_mb: 100\n", "holds no GPU memory"),
        ("device: cuda:0\n", "runs on no device"),
        ("instances: 2\n", "one instance"),
        ("max_sequences: 0\n", "max_sequences"),
    ],
)
def test_settings_a_remote_model_cannot_have_are_refused_naming_them(
    tmp_path: Path, extra: str, words: str
) -> None:
    with pytest.raises(ModelConfigError, match=words):
        spec(tmp_path, BASE + extra)


def test_the_url_must_be_http_and_the_remote_model_named(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="base_url"):
        spec(tmp_path, BASE.replace("https://api.example.com/v1/", "ftp://x"))
    with pytest.raises(ModelConfigError, match="remote_model"):
        spec(tmp_path, "backend: remote_openai\nbase_url: http://127.0.0.1:1/v1\n")


def test_the_key_is_read_from_its_file_and_a_bad_file_is_a_config_error(tmp_path: Path) -> None:
    assert (
        read_api_key(spec(tmp_path / "a", BASE + "api_key_file: key.txt\n", **{"key.txt": "  sk-123\n"}))
        == "sk-123"
    )
    assert read_api_key(spec(tmp_path / "b", BASE)) is None
    absolute = tmp_path / "secret.key"
    absolute.write_text("sk-abs")
    assert read_api_key(spec(tmp_path / "c", BASE + f"api_key_file: {absolute}\n")) == "sk-abs"
    with pytest.raises(ModelConfigError, match=r"api_key_file .*missing\.key"):
        read_api_key(spec(tmp_path / "d", BASE + "api_key_file: missing.key\n"))
    for bad in ("", "two words", "x" * 5000):
        with pytest.raises(ModelConfigError, match="must hold one key"):
            read_api_key(spec(tmp_path / "e", BASE + "api_key_file: k\n", k=bad))
