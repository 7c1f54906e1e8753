"""Repository-wide test wiring.

Markers come from the folder a test lives in (tests/unit, tests/integration,
tests/e2e). Unit tests may not open sockets: any connect/bind fails the test.
The `redis_url` fixture gives a real Redis: `REDIS_URL` when set, else an
embedded redis-server started for the session. The run state `loadmaster up` leaves for later
commands (keyed by gateway address) goes to a folder of this session: a suite a test starts
never meets the state of the host's own suite, or of another test run that had the same port.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterator

import pytest

_TIERS = ("unit", "integration", "e2e")


def pytest_configure(config: pytest.Config) -> None:
    # Set before any test starts a process, so every `up` and CLI command a test runs inherits it.
    folder = tempfile.mkdtemp(prefix="loadmaster-test-run-")
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    os.environ["XDG_RUNTIME_DIR"] = folder


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = item.path.parts
        for tier in _TIERS:
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))
                break


@pytest.fixture(autouse=True)
def _no_sockets_in_unit_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("unit tests may not open network sockets; move this test to tests/integration")

    for name in ("connect", "connect_ex", "bind"):
        monkeypatch.setattr(socket.socket, name, refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    from loadmaster.cli.redis_server import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server.url
