"""Model ladders (`models.aliases`) and the per-category keep-alive defaults in the settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loadmaster.common.config import (
    AliasSettings,
    CategoryKeepAliveSettings,
    ConfigError,
    Settings,
    load_settings,
)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.upper().startswith("LOADMASTER_") or key.upper() == "REDIS_URL":
            monkeypatch.delenv(key)


@pytest.fixture()
def deploy(tmp_path: Path) -> Path:
    """A config folder whose repository holds `chat-a` and `chat-b`."""
    for name in ("chat-a", "chat-b"):
        (tmp_path / "models" / name).mkdir(parents=True)
        (tmp_path / "models" / name / "config.yaml").write_text("backend: transformers\n")
    return tmp_path


def write(folder: Path, text: str) -> Path:
    path = folder / "loadmaster.yaml"
    path.write_text(text)
    return path


def test_the_keep_alive_defaults_per_category_are_300_60_900_and_never() -> None:
    defaults = Settings().models.category_keep_alive_s
    assert (defaults.llm, defaults.vision, defaults.diffusion, defaults.other) == (300.0, 60.0, 900.0, None)
    assert defaults == CategoryKeepAliveSettings()


def test_category_keep_alive_is_read_from_yaml(deploy: Path) -> None:
    settings = load_settings(write(deploy, "models: {category_keep_alive_s: {llm: 5, other: 30}}\n"))
    keep = settings.models.category_keep_alive_s
    assert (keep.llm, keep.vision, keep.diffusion, keep.other) == (5.0, 60.0, 900.0, 30.0)


def test_category_keep_alive_must_be_positive(deploy: Path) -> None:
    with pytest.raises(ConfigError, match=r"models\.category_keep_alive_s\.llm"):
        load_settings(write(deploy, "models: {category_keep_alive_s: {llm: 0}}\n"))


def test_an_alias_is_a_ladder_of_models_in_the_repository(deploy: Path) -> None:
    settings = load_settings(
        write(
            deploy,
            "models:\n  aliases:\n    chat: [chat-a, chat-b]\n"
            "    chat-pinned: {models: [chat-b, chat-a], pin_primary: true}\n",
        )
    )
    assert settings.models.aliases == {
        "chat": AliasSettings(models=["chat-a", "chat-b"]),
        "chat-pinned": AliasSettings(models=["chat-b", "chat-a"], pin_primary=True),
    }


def test_a_model_listed_in_known_may_be_a_target_without_a_folder(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, "models:\n  known: {remote: {}}\n  aliases: {chat: [remote]}\n"))
    assert settings.models.aliases["chat"].models == ["remote"]


def test_an_unknown_alias_target_is_refused_at_load_naming_the_alias_and_the_model(deploy: Path) -> None:
    path = write(deploy, "models:\n  aliases: {chat: [chat-a, chat-c]}\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    message = str(caught.value)
    assert str(path) in message
    assert "models.aliases.chat: unknown model 'chat-c'" in message
    assert "(got" not in message  # not the whole settings dump


def test_without_the_repository_on_this_host_targets_must_be_known(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown model 'chat-a'.*not on this host"):
        load_settings(write(tmp_path, "models:\n  aliases: {chat: [chat-a]}\n"))


@pytest.mark.parametrize(
    ("aliases", "needle"),
    [
        ("{chat: []}", r"models\.aliases\.chat\.models"),
        ("{chat: [chat-a, chat-a]}", "appears twice in the ladder: chat-a"),
        ("{chat-a: [chat-b]}", "'chat-a' is already a model's name"),
        ("{chat: [chat-a], more: [chat], }", "'chat' is an alias; a ladder lists models"),
        ("{chat: {models: [chat-a], pin: true}}", r"models\.aliases\.chat\.pin.*unknown key"),
    ],
)
def test_bad_ladders_are_refused_with_the_key(deploy: Path, aliases: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_settings(write(deploy, f"models:\n  aliases: {aliases}\n"))


def test_an_alias_from_the_environment(deploy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOADMASTER_MODELS__ALIASES", '{"chat": {"models": ["chat-b", "chat-a"]}}')
    settings = load_settings(write(deploy, "log_level: info\n"))
    assert settings.models.aliases["chat"].models == ["chat-b", "chat-a"]


def test_the_example_config_names_real_models() -> None:
    example = Path(__file__).resolve().parents[4] / "examples" / "loadmaster.yaml"
    settings = load_settings(example)
    assert settings.models.aliases, "examples/loadmaster.yaml shows a ladder"
    for ladder in settings.models.aliases.values():
        for model in ladder.models:
            assert (settings.repository_path / model / "config.yaml").is_file()
