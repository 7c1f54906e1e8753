"""bench/llm_serving.py's Loadmaster side end to end: the suite started as the bench starts it
(tiny-chat preloaded), driven through the gateway's OpenAI routes by the real async `openai`
client: a few short streams per concurrency and one priority round, then the suite stopped."""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import llm_serving  # noqa: E402
from _llm_servers import MODEL_FOLDER, loadmaster_server  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (MODEL_FOLDER / "config.json").exists(), reason="tiny-chat not built: `make models`"
    ),
]


@pytest.mark.timeout(300)
def test_the_bench_measures_the_suite_and_stops_it() -> None:
    args = argparse.Namespace(
        side_budget_s=200.0,
        windows=1,
        concurrency=[1, 4],
        requests=4,
        tokens=8,
        probes=3,
        background=4,
        loadmaster_max_inflight=0,
    )
    side = llm_serving.run_sides({"loadmaster": loadmaster_server(args)}, args)["loadmaster"]
    assert side["ok"] is True, (side.get("error"), side.get("log_tail"))
    assert [run["concurrency"] for run in side["runs"]] == [1, 4]
    for run in side["runs"]:
        requests = max(4, 4 * run["concurrency"])
        assert run["failed"] == 0 and run["requests"] == requests
        assert 0 < run["output_tokens"] <= requests * 8  # the gateway's usage, capped by max_tokens
        assert run["time_to_first_token"]["count"] == requests
    priority = side["priority"]
    assert priority["idle_ttft"]["count"] == 3 and priority["loaded_ttft"]["count"] == 3
    assert priority["background_failed"] == 0 and priority["background_requests_finished"] >= 4
    assert any("the scheduler admits" in note for note in side["notes"])
    port = int(side["server"].rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as sock:  # the suite was stopped: its gateway no longer answers
        assert sock.connect_ex(("127.0.0.1", port)) != 0
