"""bench/llm_serving.py's measurement code against the real reference server: `transformers
serve --continuous-batching` on tiny-chat, started and stopped by the bench's own helper, driven
by the real async `openai` client (a few short streams, one priority round), beside a side whose
server is not there (it fails alone)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import llm_serving  # noqa: E402
from _llm_client import Target  # noqa: E402
from _llm_servers import MODEL_FOLDER, reference_server  # noqa: E402

pytest.importorskip("fastapi", reason="transformers serve needs fastapi (requirements-dev.txt)")
pytest.importorskip("accelerate", reason="transformers serve needs accelerate (requirements-dev.txt)")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (MODEL_FOLDER / "config.json").exists(), reason="tiny-chat not built: `make models`"
    ),
]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.timeout(240)
def test_the_bench_measures_transformers_serve_and_stops_it(tmp_path: Path) -> None:
    args = argparse.Namespace(
        side_budget_s=150.0,
        windows=2,
        concurrency=[1, 4],
        requests=4,
        tokens=8,
        probes=3,
        background=4,
        device="cpu",
        reference_threads=1,
        reference_args="",
    )
    refused = _closed_port()

    @contextmanager
    def nothing_listening() -> Iterator[Target]:
        yield Target("loadmaster", f"http://127.0.0.1:{refused}/v1", "tiny-chat", priority_field=True)

    sides = llm_serving.run_sides(
        {"reference": reference_server(args, tmp_path), "loadmaster": nothing_listening}, args
    )
    # The side that is not there fails at its first request; the reference is measured throughout.
    assert sides["loadmaster"]["ok"] is False
    assert sides["loadmaster"]["error"].startswith("the first request failed: APIConnectionError")
    side = sides["reference"]
    assert side["ok"] is True, side.get("error")
    assert [run["concurrency"] for run in side["runs"]] == [1, 4]
    for run in side["runs"]:
        assert run["failed"] == 0
        requests = 2 * max(2, 4 * run["concurrency"])  # 2 windows of --requests / 2, at least 4x C
        assert run["requests"] == requests
        assert 0 < run["output_tokens"] <= requests * 8  # usage counts, capped by max_tokens
        assert run["time_to_first_token"]["count"] == requests
        assert run["windows"] == 2 and len(run["window_tokens_per_s"]) == 2
    priority = side["priority"]
    assert priority["idle_ttft"]["count"] == 3 and priority["loaded_ttft"]["count"] == 3
    assert priority["background_requests_finished"] >= 4
    assert priority["ratio_loaded_p99_to_idle_p50"] > 0
    assert any(note.startswith("command: serve --continuous-batching --device cpu") for note in side["notes"])
    # The server was stopped: its port no longer answers.
    port = int(side["server"].rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0
    assert os.path.exists(tmp_path / "reference.log")
