"""`EngineProcess` with small real processes (sh, python): output reaches the worker's log
line by line with the prefix, an exit is reported with its status, stop() takes down the
whole group (SIGKILL for what ignores SIGTERM), and no engine outlives a worker killed with
SIGKILL (the parent-death signal, from the thread that started it, as the engine does)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from loadmaster.model_pool.engines.engine_process import EngineExitedError, EngineProcess, engine_env
from loadmaster.model_pool.repository import ModelConfigError


def _alive(pid: int) -> bool:
    """Running (a zombie that init has not reaped yet is not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _until(condition: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_output_goes_to_the_log_with_a_prefix_and_the_exit_is_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    exits: list[int] = []
    process = EngineProcess(
        ["sh", "-c", "echo loading weights; echo 'oops' >&2; exit 3"],
        env=engine_env(os.environ, gpus=(1, 2)),
        name="m",
        on_exit=exits.append,
    )
    with caplog.at_level(logging.INFO, logger="loadmaster.model_pool.engine"):
        process.start()
        _until(lambda: exits)
    assert exits == [3]
    lines = [r.getMessage() for r in caplog.records]
    assert "[engine m] loading weights" in lines and "[engine m] oops" in lines
    assert "[engine m] exited with status 3" in lines
    assert process.tail() == "loading weights\noops"
    with pytest.raises(EngineExitedError, match="exited with status 3 while starting"):
        process.wait_healthy("http://127.0.0.1:9/health", timeout_s=5)


def test_the_engine_sees_the_lease_gpus() -> None:
    exits: list[int] = []
    process = EngineProcess(
        ["sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES"; exit 0'],
        env=engine_env(os.environ, gpus=(1, 2)),
        name="env",
        on_exit=exits.append,
    )
    process.start()
    _until(lambda: exits)
    assert process.tail() == "1,2"


def test_stop_kills_the_whole_group_after_the_grace() -> None:
    # A leader that ignores SIGTERM and a child of its own that does too.
    script = "trap '' TERM; sleep 300 & echo child $!; while true; do sleep 0.05; done"
    exits: list[int] = []
    process = EngineProcess(["sh", "-c", script], env=dict(os.environ), name="stubborn", on_exit=exits.append)
    process.start()
    _until(lambda: process.tail().startswith("child "))
    child = int(process.tail().split()[1])
    assert os.getpgid(child) == process.pid  # one process group
    started = time.monotonic()
    status = process.stop(grace_s=0.5)
    assert time.monotonic() - started >= 0.5  # SIGTERM was given its grace first
    assert status == -signal.SIGKILL
    assert not _alive(process.pid) and not _alive(child)
    assert exits == []  # a stop is not a crash


def test_no_engine_outlives_a_worker_killed_with_sigkill() -> None:
    # A stand-in worker: starts an engine from a non-main thread (as the pool's instance
    # thread does), prints its pid, and keeps running until it is killed.
    worker_code = textwrap.dedent(
        """
        import os, sys, threading, time
        from loadmaster.model_pool.engines.engine_process import EngineProcess
        started = []
        def load():
            process = EngineProcess(["sleep", "300"], env=dict(os.environ), name="orphan")
            process.start()
            started.append(process.pid)
            time.sleep(3600)  # the instance thread lives as long as the engine
        threading.Thread(target=load, daemon=True).start()
        while not started:
            time.sleep(0.01)
        print(started[0], flush=True)
        time.sleep(3600)
        """
    )
    worker = subprocess.Popen([sys.executable, "-c", worker_code], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None
        engine_pid = int(worker.stdout.readline())
        assert _alive(engine_pid)
        worker.kill()
        worker.wait(10)
        _until(lambda: not _alive(engine_pid))
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)


def test_an_engine_that_never_gets_healthy_times_out_with_its_output() -> None:
    process = EngineProcess(["sh", "-c", "echo still loading; sleep 30"], env=dict(os.environ), name="slow")
    process.start()
    try:
        _until(lambda: process.tail() == "still loading")
        with pytest.raises(TimeoutError, match=r"not healthy at http://127\.0\.0\.1:9/health within 0s"):
            process.wait_healthy("http://127.0.0.1:9/health", timeout_s=0.3)
    finally:
        process.stop(grace_s=1.0)
    assert not _alive(process.pid)


def test_a_command_that_cannot_start_is_a_config_error() -> None:
    process = EngineProcess(["no-such-engine-binary", "--port", "1"], env=dict(os.environ), name="x")
    with pytest.raises(ModelConfigError, match="command: cannot start 'no-such-engine-binary'"):
        process.start()
