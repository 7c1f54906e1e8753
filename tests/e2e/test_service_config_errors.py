"""`python -m loadmaster.<service>` with a configuration it cannot use: one message on stderr
naming the file and the key, exit code 2, no traceback; `$LOADMASTER_CONFIG` is the default
of `--config`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SERVICES = ["gateway", "scheduler", "model_pool", "gpu_broker", "metrics"]


def _run(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LOADMASTER_")}
    return subprocess.run(
        [sys.executable, "-m", f"loadmaster.{module}", *args],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("module", SERVICES)
def test_a_bad_config_is_one_message_and_exit_2(module: str, tmp_path: Path) -> None:
    config = tmp_path / "loadmaster.yaml"
    config.write_text("gateway:\n  http_port: eighty\n")
    done = _run(module, "--config", str(config))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"invalid configuration in {config}:" in done.stderr
    assert "gateway.http_port: Input should be a valid integer" in done.stderr


def test_loadmaster_config_is_the_default_and_broken_yaml_names_its_line(tmp_path: Path) -> None:
    config = tmp_path / "broken.yaml"
    config.write_text("scheduler:\n  tiers: [1\n")
    done = _run("scheduler", env={"LOADMASTER_CONFIG": str(config)})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"python -m loadmaster.scheduler: {config}: not valid YAML (line 3, column 1): "
        "expected ',' or ']', but got '<stream end>'"
    )
