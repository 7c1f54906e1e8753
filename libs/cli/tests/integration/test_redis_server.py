"""The embedded redis-server: a password on every connection, and an AOF that brings the data
back after the server is killed."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import redis

from loadmaster.cli.redis_server import EmbeddedRedis


def test_refuses_commands_without_the_password() -> None:
    with EmbeddedRedis() as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(b"SET k v\r\nFLUSHALL\r\nAUTH wrong\r\n")
            replies = _lines(sock, 3)
        assert replies[0].startswith(b"-NOAUTH") and replies[1].startswith(b"-NOAUTH"), replies
        assert replies[2].startswith(b"-WRONGPASS"), replies
        assert server.password and server.password in server.url
        client = redis.Redis.from_url(server.url)
        assert client.get("k") is None  # the refused SET did nothing
        assert client.set("k", "v") and client.get("k") == b"v"
        client.close()


def _lines(sock: socket.socket, count: int) -> list[bytes]:
    data = b""
    while data.count(b"\r\n") < count:
        chunk = sock.recv(1024)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    return data.split(b"\r\n")[:count]


def test_data_survives_a_killed_server(tmp_path: Path) -> None:
    server = EmbeddedRedis(data_dir=str(tmp_path)).start()
    try:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
        client.hset("lease:1", mapping={"holder": "w", "mb": "1000"})
        client.incr("fencing")
        client.close()
        # appendfsync everysec: the write itself may wait while an fsync runs (Redis's own rule,
        # up to ~2 s); what is in the file must survive a kill -9.
        deadline = time.monotonic() + 5
        while not any(b"fencing" in f.read_bytes() for f in tmp_path.rglob("*.aof*") if f.is_file()):
            assert time.monotonic() < deadline, "nothing reached the append-only file"
            time.sleep(0.05)
        assert server.pid is not None
        os.killpg(server.pid, signal.SIGKILL)  # no shutdown: only the AOF can bring the data back
        server.process.wait()  # type: ignore[union-attr]
        assert server.exited() == -signal.SIGKILL
        url = server.url
        server.restart()
        assert server.url == url  # same port and password: clients' REDIS_URL stays valid
        client = redis.Redis.from_url(url)
        assert client.hgetall("lease:1") == {b"holder": b"w", b"mb": b"1000"}
        assert client.get("fencing") == b"1"
        client.close()
        # A new server on the same folder (another launcher) takes the same password.
        server.stop()
        again = EmbeddedRedis(port=server.port, data_dir=str(tmp_path)).start()
        try:
            assert again.url == url
            assert redis.Redis.from_url(url).get("fencing") == b"1"
        finally:
            again.stop()
    finally:
        server.stop()
