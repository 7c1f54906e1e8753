from __future__ import annotations

from rich.console import Console

from loadmaster.cli.top_cmd import dashboard_url, render, sparkline
from loadmaster.common.config import MetricsSettings, Settings

DOC = {
    "summary_s": 10.0,
    "t": [-2.0, -1.0, 0.0],
    "models": {
        "double": {
            "throughput_rps": [0.0, 50.0, 100.0],
            "summary": {
                "p50_ms": 1.234,
                "p95_ms": 2.5,
                "p99_ms": 9.0,
                "throughput_rps": 99.5,
                "queue_depth": 3.0,
                "deadline_misses": 4,
                "errors": 5,
            },
        }
    },
    "gpus": {"local/gpu0": {"lease_mb": [None, 10.0, 20.0], "lease_mb_now": 20.0, "free_mb_now": 980.0}},
    "workers": [
        {"worker_id": "w1", "slots": [{"model": "double", "state": "READY", "inflight": 1, "vram_mb": 16}]}
    ],
}


def test_sparkline_scales_to_the_highest_value_and_keeps_gaps() -> None:
    assert sparkline([0.0, 50.0, 100.0]) == "▁▄█"
    assert sparkline([None, 1.0]) == " █"
    assert sparkline([0.0, 0.0]) == "▁▁"
    assert len(sparkline([1.0] * 100, width=30)) == 30


def test_render_shows_models_gpus_and_workers() -> None:
    console = Console(width=160, record=True, color_system=None)
    console.print(render(DOC, source="http://x"))
    text = console.export_text()
    for expected in ("double", "1.23", "99.5", "local/gpu0", "980", "w1", "READY", "▁▄█"):
        assert expected in text, expected


def test_render_shows_tokens_per_second_and_time_to_first_token_per_generative_model() -> None:
    doc = {
        **DOC,
        "generative": {
            "tiny-chat": {
                "tokens_per_s": [None, 600.0, 1200.0],
                "ttft_p50_ms": [None, 7.0, 8.0],
                "ttft_p95_ms": [None, 20.0, 30.0],
                "summary": {"tokens_per_s": 1234.5, "ttft_p50_ms": 7.25, "ttft_p95_ms": 31.5},
            }
        },
    }
    console = Console(width=160, record=True, color_system=None)
    console.print(render(doc, source="http://x"))
    text = console.export_text()
    assert "generative models (last 10 s)" in text
    (row,) = [line for line in text.splitlines() if "tiny-chat" in line]
    for expected in ("1234.5", "7.25", "31.50", " ▄█"):
        assert expected in row, expected
    for column in ("tokens/s", "TTFT p50 ms", "TTFT p95 ms"):
        assert column in text, column


def test_render_leaves_the_generative_table_out_when_no_model_generates() -> None:
    console = Console(width=160, record=True, color_system=None)
    console.print(render({**DOC, "generative": {}}, source="http://x"))
    assert "generative" not in console.export_text()


def test_dashboard_url_reaches_a_wildcard_bind_on_loopback() -> None:
    settings = Settings(metrics=MetricsSettings(http_host="0.0.0.0", http_port=9000))
    url = dashboard_url(settings, window_s=60, summary_s=10)
    assert url == "http://127.0.0.1:9000/api/dashboard?window_s=60&step_s=1&summary_s=10"
