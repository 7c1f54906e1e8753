"""The reference server for bench/llm_serving.py: `transformers serve --continuous-batching`.

Started as its docs show, through its own CLI (the `transformers` script beside this
interpreter), on a free 127.0.0.1 port, with the model folder as its forced model:

    transformers serve --continuous-batching --device cpu --host 127.0.0.1 --port P FOLDER

It needs `fastapi`, `uvicorn` and `accelerate` beside transformers (requirements-dev.txt).
`hf_serve()` yields the OpenAI base URL and the model id the server answers to (it names the
model by its folder path), and stops the server's process group on the way out.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from loadmaster.common.ports import free_port

_READY_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class Served:
    base_url: str  # ends in /v1
    model: str
    command: tuple[str, ...]
    process: subprocess.Popen[bytes]
    log_path: Path | None

    def diagnose(self) -> str:
        """Whether it still runs, and the tail of its log."""
        code = self.process.poll()
        state = "running" if code is None else f"exited with {code}"
        return f"transformers serve (pid {self.process.pid}) {state}\n{_tail(self.log_path)}"


def serve_command(folder: Path, *, port: int, device: str, extra: tuple[str, ...] = ()) -> list[str]:
    script = Path(sys.executable).with_name("transformers")
    executable = str(script) if script.exists() else shutil.which("transformers")
    if executable is None:
        raise RuntimeError("the `transformers` CLI is not installed beside this interpreter")
    return [
        executable,
        "serve",
        "--continuous-batching",
        "--device",
        device,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
        str(folder),
    ]


@contextmanager
def hf_serve(
    folder: Path,
    *,
    device: str = "cpu",
    extra: tuple[str, ...] = (),
    threads: int | None = None,
    log_path: Path | None = None,
) -> Iterator[Served]:
    """Yield the running reference server (see the module docstring). `threads`: set
    OMP_NUM_THREADS for it (None: its default, torch's own choice)."""
    port = free_port()
    command = serve_command(folder, port=port, device=device, extra=extra)
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    log = open(log_path, "wb") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(command, stdout=log, stderr=log, env=env, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        model = _wait_ready(base, proc, log_path)
        yield Served(f"{base}/v1", model, tuple(command), proc, log_path)
    finally:
        _stop(proc)
        if log_path is not None:
            log.close()  # type: ignore[union-attr]


def _tail(log_path: Path | None, lines: int = 15) -> str:
    if log_path is None or not log_path.exists():
        return ""
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])


def _wait_ready(base: str, proc: subprocess.Popen[bytes], log_path: Path | None) -> str:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`transformers serve` exited with {proc.returncode}:\n{_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=2) as response:
                models = json.loads(response.read())["data"]
            if models:
                return str(models[0]["id"])
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise TimeoutError(
        f"`transformers serve` did not answer within {_READY_TIMEOUT_S:.0f} s:\n{_tail(log_path)}"
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
