"""An external engine process: its command line, environment, output, health and stop.

    argv = render_command(template, model_path=..., port=..., host=..., gpus=(0, 1))
    env = engine_env(os.environ, gpus=(0, 1), extra={...})
    process = EngineProcess(argv, env=env, name="tiny-chat-process", on_exit=callback)
    process.start()            # own session (process group), dies with this process
    process.wait_healthy(url, timeout_s=...)  # polls until 200, fails fast if it exits
    process.stop(grace_s=10)   # SIGTERM the group, SIGKILL after the grace, until all are gone

The engine's stdout and stderr go to this worker's log line by line, prefixed with
`[engine <name>]`. `on_exit(status)` is called (on the output thread) when the process
exits by itself, not when `stop` ended it. Everything here blocks: the engine calls it on
its instance's thread, never on the event loop.

Parent death: the child is wrapped by `loadmaster.common.child_processes.die_with_parent`
(PR_SET_PDEATHSIG), as the launcher's services are. The kernel sends the signal when the
*thread* that forked the child exits; the engine starts it from its instance's thread,
which lives until the engine is unloaded, so the engine dies with the worker and not before.
"""

from __future__ import annotations

import collections
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import IO

import httpx
import psutil

from loadmaster.common.child_processes import die_with_parent, signal_group
from loadmaster.common.retry import Backoff
from loadmaster.model_pool.repository import ModelConfigError

__all__ = ["EngineExitedError", "EngineProcess", "engine_env", "gpus_of", "render_command"]

log = logging.getLogger("loadmaster.model_pool.engine")

_PLACEHOLDERS = ("model_path", "port", "host", "gpus", "num_gpus")
_MAX_LINE = 4096  # characters of one output line that reach the log
_TAIL_LINES = 20  # last output lines kept for error messages
_POLL_S = (0.05, 0.5)  # health polling: first and longest pause between attempts


class EngineExitedError(RuntimeError):
    """The engine process exited while it was starting."""


def render_command(
    template: str | Sequence[str], *, model_path: str, port: int, host: str, gpus: Sequence[int]
) -> list[str]:
    """The command line with `{model_path}`, `{port}`, `{host}`, `{gpus}` (comma-separated,
    as CUDA_VISIBLE_DEVICES) and `{num_gpus}` filled in. A string is split like a shell
    would (quotes kept together); no shell runs it. Unknown `{names}` are config errors."""
    argv = shlex.split(template) if isinstance(template, str) else list(template)
    values = {
        "model_path": model_path,
        "port": str(port),
        "host": host,
        "gpus": ",".join(str(gpu) for gpu in gpus),
        "num_gpus": str(max(1, len(gpus))),
    }
    out = []
    for part in argv:
        try:
            out.append(part.format(**values))
        except (KeyError, IndexError, ValueError) as error:
            raise ModelConfigError(
                f"command: {part!r} has an unknown placeholder {error} "
                f"(known: {', '.join('{' + name + '}' for name in _PLACEHOLDERS)})"
            ) from None
    return out


def engine_env(
    base: Mapping[str, str], *, gpus: Sequence[int] | None, extra: Mapping[str, str] = {}
) -> dict[str, str]:
    """The engine's environment: `base` without Loadmaster's own settings (credentials
    among them: an engine is third-party code), + `extra`, with CUDA_VISIBLE_DEVICES set to
    the lease's GPUs (NVML's PCI-bus order, so index N is the GPU the broker means), or to
    nothing (`gpus` None: a CPU model sees no GPU)."""
    env = {key: value for key, value in base.items() if not key.startswith("LOADMASTER_")}
    env.update(extra)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["CUDA_VISIBLE_DEVICES"] = "" if gpus is None else ",".join(str(gpu) for gpu in gpus)
    env.setdefault("PYTHONUNBUFFERED", "1")  # Python engines: output reaches the log as it comes
    return env


class EngineProcess:
    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        name: str,
        on_exit: Callable[[int], None] | None = None,
        cwd: str | None = None,
    ) -> None:
        self.argv = list(argv)
        self.name = name
        self._env = dict(env)
        self._cwd = cwd
        self._on_exit = on_exit
        self._process: subprocess.Popen[bytes] | None = None
        self._pump: threading.Thread | None = None
        self._stopping = False
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.poll()

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def tail(self) -> str:
        """The engine's last output lines, for error messages."""
        return "\n".join(self._tail)

    def start(self) -> None:
        try:
            self._process = subprocess.Popen(
                die_with_parent([_executable(self.argv[0], self._cwd), *self.argv[1:]]),
                env=self._env,
                cwd=self._cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() signals all of it
            )
        except OSError as error:
            raise ModelConfigError(
                f"command: cannot start {self.argv[0]!r}: {error.strerror or error}"
            ) from None
        assert self._process.stdout is not None
        self._pump = threading.Thread(
            target=self._read_output, args=(self._process.stdout,), name=f"engine-{self.name}", daemon=True
        )
        self._pump.start()
        log.info("[engine %s] started pid %d: %s", self.name, self._process.pid, shlex.join(self.argv))

    def wait_healthy(self, url: str, *, timeout_s: float) -> None:
        """Poll `url` until it answers 200; raise `EngineExitedError` if the process exits
        first, `TimeoutError` when `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        pause = Backoff(first_s=_POLL_S[0], max_s=_POLL_S[1])
        with httpx.Client(timeout=2.0) as client:
            while True:
                status = self.returncode
                if status is not None:
                    raise EngineExitedError(
                        f"engine process exited with status {status} while starting; its last output:\n"
                        f"{self.tail()}"
                    )
                try:
                    if client.get(url).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"engine not healthy at {url} within {timeout_s:.0f}s; its last output:\n{self.tail()}"
                    )
                time.sleep(pause.next_s())

    def group_pids(self) -> set[int]:
        """The engine and every process of its group (workers it spawned)."""
        if self._process is None:
            return set()
        pids = {self._process.pid}
        try:
            pids.update(child.pid for child in psutil.Process(self._process.pid).children(recursive=True))
        except psutil.Error:
            pass
        return pids

    def stop(self, *, grace_s: float) -> int | None:
        """SIGTERM the whole process group, SIGKILL it after `grace_s`, and return once the
        engine is reaped and no process of its group is left. Returns its exit status."""
        process = self._process
        if process is None:
            return None
        self._stopping = True
        pids = self.group_pids()
        deadline = time.monotonic() + grace_s
        signal_group(process, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        # Its workers may still be shutting down after the leader: the rest of the grace is theirs.
        if not _wait_group_gone(
            process.pid, pids, timeout_s=max(0.0, deadline - time.monotonic()), kill=False
        ):
            log.warning("[engine %s] still running %.1fs after SIGTERM: SIGKILL", self.name, grace_s)
        signal_group(process, signal.SIGKILL)  # whatever of the group is left (the leader may be gone)
        process.wait()
        if not _wait_group_gone(process.pid, pids, timeout_s=grace_s, kill=True):
            log.error("[engine %s] processes of its group survive SIGKILL: %s", self.name, sorted(pids))
        if self._pump is not None:
            self._pump.join(timeout=grace_s)
        return process.returncode

    def _read_output(self, stream: IO[bytes]) -> None:
        try:
            for raw in stream:
                line = raw.decode("utf-8", errors="replace").rstrip()
                if line:
                    line = line[:_MAX_LINE]
                    self._tail.append(line)
                    log.info("[engine %s] %s", self.name, line)
        except (OSError, ValueError):
            pass
        finally:
            stream.close()
        process = self._process
        assert process is not None
        status = process.wait()
        if self._stopping:
            return
        log.error("[engine %s] exited with status %d", self.name, status)
        if self._on_exit is not None:
            try:
                self._on_exit(status)
            except Exception:
                log.exception("[engine %s] exit handler failed", self.name)


def _executable(name: str, cwd: str | None) -> str:
    """The program to run: a path (relative ones from the engine's working directory, the
    model folder), else `name` as found on PATH, else beside this Python (a virtual
    environment's console scripts, such as `transformers`, when the venv is not on PATH)."""
    if os.sep in name:
        path = Path(cwd or ".") / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    elif shutil.which(name) is not None:
        return name
    elif (beside := Path(sys.executable).with_name(name)).exists():
        return str(beside)
    raise ModelConfigError(f"command: cannot start {name!r}: no such executable")


def _wait_group_gone(pgid: int, pids: Collection[int], *, timeout_s: float, kill: bool) -> bool:
    """Until no process of group `pgid` is left running (a zombie waiting for init to reap
    it holds no memory), at most `timeout_s`; with `kill`, SIGKILL again what is left."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL if kill else 0)
        except (ProcessLookupError, PermissionError):
            return True
        if not any(_running(pid) for pid in pids):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def gpus_of(device: str, lease_gpus: Collection[int]) -> tuple[int, ...] | None:
    """The GPUs an engine process may see: the lease's for a `cuda` device, none for `cpu`."""
    return tuple(sorted(lease_gpus)) if device.startswith("cuda") else None
