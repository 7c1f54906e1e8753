"""`loadmaster up` as a real process tree: kill -9 the worker, the scheduler and redis-server in
turn; each is restarted and the suite serves a stock client's request again within 5 s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.http as triton

from loadmaster.cli.launcher import free_port_overrides, to_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[4]
CONFIG = ROOT / "examples" / "loadmaster.yaml"
RECOVER_S = 5.0


def _infer(address: str) -> bool:
    client = triton.InferenceServerClient(address, connection_timeout=1.0, network_timeout=2.0)
    try:
        x = np.arange(4, dtype=np.float32)
        tensor = triton.InferInput("x", [4], "FP32")
        tensor.set_data_from_numpy(x)
        return bool(np.array_equal(client.infer("double", [tensor]).as_numpy("x"), x * 2))
    except Exception:  # any failure means "not serving yet"
        return False
    finally:
        client.close()


def _until_serving(address: str, timeout_s: float) -> float:
    """Seconds until a request succeeds; fails the test after `timeout_s`."""
    started = time.monotonic()
    while not _infer(address):
        assert time.monotonic() - started < timeout_s, f"not serving within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - started


def _process(up: subprocess.Popen[bytes], marker: str) -> psutil.Process:
    for child in psutil.Process(up.pid).children(recursive=True):
        try:
            if marker in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no process {marker!r} under loadmaster up")


@pytest.fixture()
def up(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path, dict[str, str]]]:
    overrides = free_port_overrides()
    overrides["model_pool"]["preload"] = ["double"]
    log = tmp_path / "up.log"
    stdout = tmp_path / "up.json"
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "LOADMASTER_REDIS_URL")}
    env.update(to_env(overrides))
    with log.open("wb") as err, stdout.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "loadmaster.cli.main", "up", "--config", str(CONFIG), "--json"],
            env={**env, "COLUMNS": "200"},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    http = f"127.0.0.1:{overrides['gateway']['http_port']}"
    try:
        yield process, http, log, env
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        print("---- loadmaster up (tail) ----\n" + "\n".join(log.read_text().splitlines()[-60:]))


def test_up_restarts_killed_processes(
    up: tuple[subprocess.Popen[bytes], str, Path, dict[str, str]],
) -> None:
    process, http, log, env = up
    _until_serving(http, 180)
    printed = log.parent / "up.json"  # `up --json` prints once its status is taken
    deadline = time.monotonic() + 30
    while not printed.read_text().endswith("\n"):
        assert time.monotonic() < deadline, "loadmaster up --json printed nothing"
        time.sleep(0.1)
    started = json.loads(printed.read_text().splitlines()[0])
    assert started["endpoints"]["gateway HTTP"] == f"http://{http}"
    assert started["endpoints"]["redis"].startswith("redis://:***@127.0.0.1:")
    recovered: dict[str, float] = {}
    for label, marker in (
        ("model-pool", "loadmaster.model_pool"),
        ("scheduler", "loadmaster.scheduler"),
        ("redis", "redis-server"),
    ):
        victim = _process(process, marker)
        victim.send_signal(signal.SIGKILL)
        victim.wait(5)
        recovered[label] = _until_serving(http, RECOVER_S)
        assert process.poll() is None, f"loadmaster up exited after {label} was killed"
        # The killed process really is back (a request may not need Redis at all).
        deadline = time.monotonic() + 30
        while True:
            try:
                if _process(process, marker).pid != victim.pid:
                    break
            except AssertionError:
                pass
            assert time.monotonic() < deadline, f"{label} was not restarted"
            time.sleep(0.1)
        assert f"{label} killed by SIGKILL; restart 1/5" in log.read_text()
    print(f"serving again after kill -9 (s): {recovered}")
    # `status` finds the embedded Redis (and its password) through the running `up`.
    status = subprocess.run(
        [sys.executable, "-m", "loadmaster.cli.main", "status", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stdout + status.stderr
    assert json.loads(status.stdout)["redis"]["reachable"]
    os.killpg(process.pid, signal.SIGTERM)
    assert process.wait(30) == 0
