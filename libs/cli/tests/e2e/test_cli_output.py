"""The `loadmaster` commands against a real suite (the launcher's processes on free ports):
`--json` everywhere a table is printed, full-width tables when piped, and `status` exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loadmaster.cli.launcher import Suite, free_port_overrides, to_env
from loadmaster.cli.main import app

ROOT = Path(__file__).resolve().parents[4]
CONFIG = ROOT / "examples" / "loadmaster.yaml"
runner = CliRunner()


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    overrides = free_port_overrides()
    overrides["model_pool"]["preload"] = ["double"]
    running = Suite(CONFIG, overrides=overrides, log_dir=tmp_path_factory.mktemp("cli-suite"))
    running.start(timeout_s=120)
    try:
        running.wait_for_models(["double"], timeout_s=120)
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def env(suite: Suite) -> dict[str, str]:
    """What a shell pointed at this suite has: its addresses, and REDIS_URL."""
    return {**to_env(suite.overrides), "REDIS_URL": suite.settings.redis_url or ""}


def _cli(env: dict[str, str], *args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.stdout


def test_models_list_piped_is_full_width_and_json_parses(env: dict[str, str]) -> None:
    command = [sys.executable, "-m", "loadmaster.cli.main", "models", "list"]
    clean = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    piped = subprocess.run(command, env={**clean, **env}, capture_output=True, text=True, timeout=60)
    assert piped.returncode == 0, piped.stderr
    names = {line.split("│")[2].strip() for line in piped.stdout.splitlines() if line.count("│") > 3}
    assert {"policy", "policy-onnx", "classifier", "double"} <= names, piped.stdout  # not `polic…`
    as_json = subprocess.run(
        [*command, "--json"], env={**clean, **env}, capture_output=True, text=True, timeout=60
    )
    assert as_json.returncode == 0, as_json.stderr
    (worker,) = json.loads(as_json.stdout)["workers"]
    slots = {m["model_id"]: m for m in worker["models"]}
    assert slots["double"]["state"] == "READY" and slots["double"]["vram_mb"] > 0
    assert slots["policy-onnx"]["state"] == "IDLE"
    assert set(worker) == {"endpoint", "worker_id", "free_mb", "evictions", "models"}


def test_scheduler_queues_gpu_status_and_top_take_json(env: dict[str, str]) -> None:
    code, out = _cli(env, "scheduler", "queues", "--json")
    assert code == 0, out
    queues = json.loads(out)
    assert queues["strategy"] and isinstance(queues["queues"], list)
    code, out = _cli(env, "gpu", "status", "--json")
    assert code == 0, out
    assert json.loads(out)["gpus"][0]["total_mb"] > 0
    code, out = _cli(env, "top", "--json")
    assert code == 0, out
    assert "models" in json.loads(out)


def test_status_exit_codes(suite: Suite, env: dict[str, str], tmp_path: Path) -> None:
    code, out = _cli(env, "status", "--json")
    assert code == 0, out
    healthy = json.loads(out)
    assert healthy["ok"] and healthy["problems"] == [] and healthy["redis"]["reachable"]
    assert suite.redis is not None and suite.redis.password not in out  # redacted
    code, out = _cli(env, "status")
    assert code == 0 and "SERVING" in out and "double" in out

    assert suite.redis.pid is not None
    os.killpg(suite.redis.pid, signal.SIGKILL)
    suite.redis.process.wait()  # type: ignore[union-attr]
    try:
        code, out = _cli(env, "status", "--json")
        assert code == 1, out
        report = json.loads(out)
        assert not report["ok"] and not report["redis"]["reachable"]
        assert report["problems"][0].startswith("redis at ")
    finally:
        suite.redis.restart()

    code, out = _cli(env, "models", "unload", "double")
    assert code == 0, out
    try:
        code, out = _cli(env, "status", "--json")
        assert code == 1 and json.loads(out)["problems"] == ["no model is READY on any worker"], out
    finally:
        code, out = _cli(env, "models", "load", "double")
        assert code == 0, out
    suite.wait_for_models(["double"], timeout_s=60)
    code, out = _cli(env, "status")
    assert code == 0, out

    elsewhere = {**to_env(free_port_overrides()), "REDIS_URL": env["REDIS_URL"]}
    code, out = _cli(elsewhere, "status", "--json")
    assert code == 1
    assert len([p for p in json.loads(out)["problems"] if "is not serving" in p]) == 5

    result = runner.invoke(app, ["status", "--config", str(tmp_path / "missing.yaml")], env=env)
    assert result.exit_code == 2


def test_models_commands_exit_2_for_a_model_no_worker_has(env: dict[str, str]) -> None:
    for command in ("load", "unload", "pin"):
        result = runner.invoke(app, ["models", command, "nope"], env=env)
        assert result.exit_code == 2, (command, result.output)
        assert "no worker has model 'nope'" in result.stderr, command


def test_status_lists_every_worker_the_scheduler_knows(suite: Suite, env: dict[str, str]) -> None:
    """Not only the configured model_pool.address: a second worker on its own port shows up."""
    first = suite.service("model-pool")
    second = suite.start_service("model-pool", index=1, timeout_s=120)
    assert first is not None and first.address != second.address
    try:
        rows: list[dict[str, object]] = []
        for _ in range(100):  # it says hello to the scheduler before it turns SERVING
            _code, out = _cli(env, "status", "--json")
            rows = [r for r in json.loads(out)["services"] if str(r["name"]).startswith("model-pool")]
            if len(rows) == 2:
                break
            time.sleep(0.05)
        assert {r["address"] for r in rows} == {first.address, second.address}, rows
        assert all(r["serving"] for r in rows)
        _, out = _cli(env, "status")
        assert second.address in out and first.address in out
    finally:
        os.killpg(second.process.pid, signal.SIGTERM)
        second.process.wait(timeout=60)
        suite.processes.remove(second)
