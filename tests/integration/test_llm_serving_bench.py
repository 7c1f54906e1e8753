"""bench/llm_serving.py against a server that is not there: the real `openai` client over a
real (refused) socket; the side is reported as failed with the reason, within its budget."""

from __future__ import annotations

import argparse
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import llm_serving  # noqa: E402
from _llm_client import Target  # noqa: E402


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_side_whose_server_refuses_connections_fails_with_the_reason() -> None:
    port = _closed_port()

    @contextmanager
    def nothing_listening() -> Iterator[Target]:
        yield Target("loadmaster", f"http://127.0.0.1:{port}/v1", "tiny-chat", priority_field=True)

    args = argparse.Namespace(
        side_budget_s=20.0, windows=1, concurrency=[1], requests=2, tokens=4, probes=0, background=0
    )
    started = time.monotonic()
    side = llm_serving.run_sides({"loadmaster": nothing_listening}, args)["loadmaster"]
    assert time.monotonic() - started < 20
    assert side["ok"] is False
    assert side["error"].startswith("the first request failed: APIConnectionError")
    assert side["server"] == f"http://127.0.0.1:{port}/v1"
    assert not side.get("runs")
