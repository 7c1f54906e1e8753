"""`loadmaster up` / `loadmaster status` as a user runs them: real processes, no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from loadmaster.cli.launcher import Suite, free_port_overrides, to_env
from loadmaster.common.config import load_settings
from loadmaster.common.grpc_client import wait_for_health_sync

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "loadmaster.yaml"
LOADMASTER = [sys.executable, "-m", "loadmaster.cli.main"]


def _start_up(tmp_path: Path) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    overrides = free_port_overrides()
    overrides["model_pool"]["preload"] = ["double"]
    overrides["redis"] = {"data_dir": str(tmp_path / "redis")}  # `up` keeps Redis's data there
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env.update(to_env(overrides))
    log = (tmp_path / "up.log").open("wb")
    process = subprocess.Popen(
        [*LOADMASTER, "up", "--config", str(CONFIG)], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    settings = load_settings(CONFIG, **overrides)
    try:
        wait_for_health_sync(settings.gateway.address, timeout_s=120)
    except BaseException:
        process.kill()
        raise
    return process, env


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return alive


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_stopping_the_launcher_leaves_no_process_behind(tmp_path: Path, stop_signal: int) -> None:
    process, _ = _start_up(tmp_path)
    children = _descendants(process.pid)
    try:
        names = " ".join(" ".join(child.cmdline()) for child in children)
        for module in ("gpu_broker", "metrics", "scheduler", "model_pool", "gateway", "redis-server"):
            assert module in names, f"{module} not running under the launcher: {names}"
        process.send_signal(stop_signal)
        process.wait(timeout=30)
        alive = _wait_gone(children, timeout_s=15)
        assert alive == [], f"left behind: {[' '.join(p.cmdline()) for p in alive]}"
    finally:
        for child in children:
            if child.is_running():
                child.kill()
        if process.poll() is None:
            process.kill()


def test_status_lists_every_service_and_the_ready_models(suite: Suite) -> None:
    env = dict(os.environ)
    env.update(to_env(suite.overrides))
    assert suite.settings.redis_url
    env["REDIS_URL"] = suite.settings.redis_url  # status checks Redis too; `up` records it, a Suite does not
    result = subprocess.run(
        [*LOADMASTER, "status", "--config", str(CONFIG)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for name in ("gpu-broker", "metrics", "scheduler", "model-pool", "gateway"):
        assert name in output
    assert output.count("SERVING") == 5
    for model in suite.settings.model_pool.preload:
        assert model in output
    assert "READY" in output


def test_suite_stop_terminates_every_process(tmp_path: Path) -> None:
    overrides = free_port_overrides()
    overrides["model_pool"]["preload"] = ["double"]
    suite = Suite(CONFIG, overrides=overrides, log_dir=tmp_path)
    suite.start(timeout_s=120)
    pids = [service.process.pid for service in suite.processes]
    assert suite.redis is not None and suite.redis.process is not None
    pids.append(suite.redis.process.pid)
    started = time.monotonic()
    suite.stop()
    assert time.monotonic() - started < 15
    assert [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"] == []
