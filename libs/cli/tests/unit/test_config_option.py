"""`--config` on every command: `$LOADMASTER_CONFIG` as its default, and a configuration that
cannot be used reported as one message naming the file and the key, exit code 2, no traceback.
Every command here fails on its configuration before it opens a socket."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from loadmaster.cli.main import app

runner = CliRunner()

# Every command that reads the configuration, with the arguments it needs.
COMMANDS = [
    ["up"],
    ["status"],
    ["top", "--once"],
    ["chat", "m", "-m", "hi"],
    ["models", "list"],
    ["models", "load", "double"],
    ["models", "unload", "double"],
    ["models", "pin", "double"],
    ["scheduler", "queues"],
    ["scheduler", "use", "round_robin"],
    ["gpu", "status"],
    ["gpu", "lease", "--mb", "1", "--", "true"],
    ["keys", "internal", "--identity", "trainer/job-1"],
]


@pytest.fixture()
def bad_config(tmp_path: Path) -> Path:
    path = tmp_path / "loadmaster.yaml"
    path.write_text("scheduler:\n  max_queue_size: 0\n  max_queu_size: 3\n")
    return path


def _ids(command: list[str]) -> str:
    return " ".join(command[:2])


@pytest.mark.parametrize("command", COMMANDS, ids=_ids)
def test_a_bad_value_and_an_unknown_key_are_one_message_with_exit_2(
    command: list[str], bad_config: Path
) -> None:
    result = runner.invoke(app, [*command[:2], "--config", str(bad_config), *command[2:]])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert f"invalid configuration in {bad_config}" in result.stderr
    assert "scheduler.max_queue_size: Input should be greater than or equal to 1 (got 0)" in result.stderr
    assert "scheduler.max_queu_size: Extra inputs are not permitted (unknown key)" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", COMMANDS, ids=_ids)
def test_loadmaster_config_is_the_default_of_every_config_option(
    command: list[str], bad_config: Path
) -> None:
    result = runner.invoke(app, command, env={"LOADMASTER_CONFIG": str(bad_config)})
    assert result.exit_code == 2, result.output
    assert f"invalid configuration in {bad_config}" in result.stderr


def test_a_missing_file_and_broken_yaml_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    result = runner.invoke(app, ["models", "list", "-c", str(missing)])
    assert result.exit_code == 2
    assert (
        result.stderr.strip()
        == f"error: {missing}: cannot read the configuration file: No such file or directory"
    )
    broken = tmp_path / "broken.yaml"
    broken.write_text("models:\n  known: [1\n")
    result = runner.invoke(app, ["status", "-c", str(broken)])
    assert result.exit_code == 2
    assert f"{broken}: not valid YAML (line 3, column 1)" in result.stderr


def test_an_environment_override_is_named_by_its_variable() -> None:
    result = runner.invoke(app, ["status"], env={"LOADMASTER_GATEWAY__HTTP_PORT": "eighty"})
    assert result.exit_code == 2
    assert (
        "gateway.http_port ($LOADMASTER_GATEWAY__HTTP_PORT): Input should be a valid integer" in result.stderr
    )


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.startswith("loadmaster ") and result.stdout.split()[1][0].isdigit()
