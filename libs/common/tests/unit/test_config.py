"""Settings: YAML under environment overrides under explicit overrides, with typed sections."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loadmaster.common.config import ClientSettings, ConfigError, ModelSettings, Settings, load_settings

YAML = """
log_level: debug
scheduler:
  address: scheduler.internal:7000
  max_queue_size: 7
  overflow_policy: reject_newest
gateway:
  edge:
    bind: tcp://127.0.0.1:6000
    recv_hwm: 5
models:
  repository: models
  defaults: {max_inflight: 3, priority: 2, keep_alive_s: 60}
  known:
    policy: {vram_mb: 900, pin: true}
    detector: {max_inflight: 8}
clients:
  defaults: {latency_budget_ms: 20}
  known:
    arm-1: {latency_budget_ms: 5}
"""


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.upper().startswith("LOADMASTER_") or key.upper() == "REDIS_URL":
            monkeypatch.delenv(key)


@pytest.fixture()
def config_file(tmp_path: Path) -> Path:
    folder = tmp_path / "deploy"
    folder.mkdir()
    path = folder / "loadmaster.yaml"
    path.write_text(YAML)
    return path


def test_defaults_without_a_file() -> None:
    settings = load_settings()
    assert settings.scheduler.address == "127.0.0.1:50051"
    assert settings.gateway.edge.bind == "tcp://127.0.0.1:5555"
    assert (settings.gateway.http_port, settings.metrics.http_port) == (8000, 8002)
    assert settings.model_pool.data_bind == "tcp://127.0.0.1:5556"
    assert settings.redis_url is None
    assert settings.config_dir == Path.cwd()


def test_yaml_values_are_read_and_typed(config_file: Path) -> None:
    settings = load_settings(config_file)
    assert settings.log_level == "DEBUG"
    assert settings.scheduler.address == "scheduler.internal:7000"
    assert settings.scheduler.max_queue_size == 7
    assert settings.scheduler.overflow_policy == "reject_newest"
    assert settings.scheduler.request_ttl_ms == 5000.0  # untouched fields keep their defaults
    assert settings.gateway.edge.bind == "tcp://127.0.0.1:6000"
    assert settings.gateway.edge.send_hwm == 10_000


def test_environment_overrides_yaml_field_by_field(
    config_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOADMASTER_SCHEDULER__MAX_QUEUE_SIZE", "9")
    monkeypatch.setenv("LOADMASTER_SCHEDULER__LISTEN", "0.0.0.0:50051")
    monkeypatch.setenv("LOADMASTER_GATEWAY__EDGE__BIND", "tcp://0.0.0.0:5555")  # two levels of `__`
    monkeypatch.setenv("LOADMASTER_LOG_LEVEL", "warning")
    settings = load_settings(config_file)
    assert settings.scheduler.max_queue_size == 9
    assert settings.scheduler.listen_address == "0.0.0.0:50051"
    assert settings.scheduler.address == "scheduler.internal:7000"  # YAML sibling survives the merge
    assert settings.scheduler.overflow_policy == "reject_newest"
    assert settings.gateway.edge.bind == "tcp://0.0.0.0:5555"
    assert settings.gateway.edge.recv_hwm == 5  # YAML sibling of the nested field survives
    assert settings.log_level == "WARNING"


def test_explicit_overrides_beat_the_environment(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOADMASTER_SCHEDULER__MAX_QUEUE_SIZE", "9")
    settings = load_settings(config_file, scheduler={"max_queue_size": 11})
    assert settings.scheduler.max_queue_size == 11


def test_environment_values_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOADMASTER_SCHEDULER__MAX_QUEUE_SIZE", "0")
    with pytest.raises(ConfigError, match=r"max_queue_size \(\$LOADMASTER_SCHEDULER__MAX_QUEUE_SIZE\)"):
        load_settings()


def test_listen_defaults_to_address() -> None:
    settings = load_settings(scheduler={"address": "sched:1"})
    assert settings.scheduler.listen_address == "sched:1"
    settings = load_settings(scheduler={"address": "sched:1", "listen": "0.0.0.0:1"})
    assert settings.scheduler.listen_address == "0.0.0.0:1"


@pytest.mark.parametrize("variable", ["REDIS_URL", "LOADMASTER_REDIS_URL"])
def test_redis_url_from_the_environment(variable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(variable, "redis://redis:6379/0")
    assert load_settings().redis_url == "redis://redis:6379/0"


def test_redis_url_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("redis_url: redis://yaml:6379/1\n")
    assert load_settings(path).redis_url == "redis://yaml:6379/1"


@pytest.mark.parametrize("variable", ["REDIS_URL", "LOADMASTER_REDIS_URL"])
def test_redis_url_in_the_environment_overrides_yaml(
    variable: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("redis_url: redis://yaml:6379/1\n")
    monkeypatch.setenv(variable, "redis://env:6379/0")
    assert load_settings(path).redis_url == "redis://env:6379/0"


def test_for_model_merges_the_entry_over_the_defaults(config_file: Path) -> None:
    models = load_settings(config_file).models
    policy = models.for_model("policy")
    assert (policy.vram_mb, policy.pin) == (900, True)
    assert (policy.max_inflight, policy.priority, policy.keep_alive_s) == (3, 2, 60)  # from defaults
    detector = models.for_model("detector")
    assert (detector.max_inflight, detector.vram_mb, detector.priority) == (8, None, 2)
    assert models.for_model("unknown") == models.defaults
    assert models.defaults == ModelSettings(max_inflight=3, priority=2, keep_alive_s=60)


def test_for_client_returns_the_known_entry_or_the_defaults(config_file: Path) -> None:
    clients = load_settings(config_file).clients
    assert clients.for_client("arm-1").latency_budget_ms == 5
    assert clients.for_client("stranger").latency_budget_ms == 20
    assert clients.for_client("stranger") == ClientSettings(latency_budget_ms=20)


def test_for_client_merges_the_entry_over_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("clients:\n  defaults: {latency_budget_ms: 20}\n  known:\n    cam-2: {}\n")
    assert load_settings(path).clients.for_client("cam-2").latency_budget_ms == 20


def test_relative_repository_resolves_against_the_config_file(
    config_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    settings = load_settings(config_file)
    assert settings.config_dir == config_file.parent.resolve()
    assert settings.repository_path == (config_file.parent / "models").resolve()
    # a relative path given through the environment resolves the same way
    monkeypatch.setenv("LOADMASTER_MODELS__REPOSITORY", "../shared-models")
    assert load_settings(config_file).repository_path == (tmp_path / "shared-models").resolve()


def test_absolute_repository_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"models:\n  repository: {tmp_path / 'abs'}\n")
    assert load_settings(path).repository_path == tmp_path / "abs"


def test_without_a_file_relative_paths_resolve_against_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert load_settings().repository_path == (tmp_path / "models").resolve()


@pytest.mark.parametrize(
    "text",
    [
        "schedulr: {}\n",  # unknown section
        "scheduler: {max_queue: 5}\n",  # unknown field of a section
        "gateway: {edge: {bnd: x}}\n",  # unknown nested field
        "models: {known: {m: {max_inflight: 1, vram: 5}}}\n",  # unknown field of a model entry
        "clients: {known: {c: {budget_ms: 5}}}\n",  # unknown field of a client entry
    ],
)
def test_unknown_keys_are_rejected(text: str, tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="Extra inputs are not permitted"):
        load_settings(path)


def test_an_empty_file_gives_defaults_and_a_non_mapping_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_settings(empty).scheduler.max_queue_size == Settings().scheduler.max_queue_size
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="top level must be a mapping"):
        load_settings(listing)


def test_loading_one_file_does_not_leak_into_the_next(config_file: Path) -> None:
    assert load_settings(config_file).scheduler.max_queue_size == 7
    assert load_settings().scheduler.max_queue_size == 1000


def test_the_file_is_read_by_the_settings_object_itself(config_file: Path) -> None:
    settings = Settings(config_file=config_file)  # pydantic-settings' YAML source, no loader state
    assert settings.scheduler.max_queue_size == 7
    assert settings.config_file == config_file
    assert "config_file" not in settings.model_dump()  # a dump carries the values, not the file


@pytest.mark.parametrize("problem", ["missing", "folder", "yaml"])
def test_a_file_that_cannot_be_used_is_named(problem: str, tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    if problem == "folder":
        path.mkdir()
    elif problem == "yaml":
        path.write_text("scheduler: [\n")
    expected = {
        "missing": "cannot read the configuration file: No such file or directory",
        "folder": "cannot read the configuration file: Is a directory",
        "yaml": r"not valid YAML \(line 2, column 1\)",
    }[problem]
    with pytest.raises(ConfigError, match=f"{path}: {expected}"):
        load_settings(path)
