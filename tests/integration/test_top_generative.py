"""`loadmaster top` against the real metrics service in-process: the generative figures that the
model pool (`output_tokens`) and the gateway (`time_to_first_token_ms`) report reach the
terminal view and `--json`, and Prometheus' `/metrics`."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loadmaster.cli.main import app
from loadmaster.common.config import MetricsSettings, SchedulerSettings, Settings
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.metrics.server import MetricsServer, build


@pytest.fixture
async def metrics() -> AsyncIterator[MetricsServer]:
    settings = Settings(
        metrics=MetricsSettings(address="127.0.0.1:0", http_host="127.0.0.1", http_port=0),
        scheduler=SchedulerSettings(address="127.0.0.1:1"),  # none there: states from samples
    )
    server = await build(settings)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def _report(
    server: MetricsServer, service: str, samples: list[tuple[str, float, dict[str, str]]], *, sent: int
) -> None:
    reporter = TelemetryReporter(
        service, f"{service}-1", f"127.0.0.1:{server.port}", flush_interval_s=0.01, process_interval_s=None
    )
    reporter.start()
    for name, value, labels in samples:
        reporter.record(name, value, labels)
    await reporter.close(timeout_s=10.0)
    assert reporter.sent == sent


async def test_top_shows_tokens_per_second_and_time_to_first_token_of_a_generative_model(
    metrics: MetricsServer, tmp_path: Path
) -> None:
    chat = {"model": "tiny-chat"}
    # 320 tokens (a counter: the reporter sends one summed sample), four first tokens.
    await _report(metrics, "model-pool", [("output_tokens", 64.0, chat)] * 5, sent=1)
    ttfts = [("time_to_first_token_ms", float(v), chat) for v in (8, 10, 12, 40)]
    await _report(metrics, "gateway", ttfts, sent=4)
    config = tmp_path / "loadmaster.yaml"
    config.write_text(f"metrics:\n  http_host: 127.0.0.1\n  http_port: {metrics.http_port}\n")
    runner = CliRunner()

    as_json = await asyncio.to_thread(
        runner.invoke, app, ["top", "-c", str(config), "--json", "--summary", "10"]
    )
    assert as_json.exit_code == 0, as_json.output
    summary = json.loads(as_json.output)["generative"]["tiny-chat"]["summary"]
    assert summary["tokens_per_s"] == 32.0  # 320 tokens over the 10 s summary
    assert summary["ttft_p50_ms"] == 11.0
    assert summary["ttft_p95_ms"] == pytest.approx(35.8)

    frame = await asyncio.to_thread(
        runner.invoke, app, ["top", "-c", str(config), "--once", "--summary", "10"], terminal_width=200
    )
    assert frame.exit_code == 0, frame.output
    assert "generative models (last 10 s)" in frame.output
    (row,) = [line for line in frame.output.splitlines() if "tiny-chat" in line and "32" in line]
    assert "11" in row and "35.80" in row, row


async def test_top_shows_how_the_queue_ordered_generations(metrics: MetricsServer, tmp_path: Path) -> None:
    chat = {"model": "tiny-chat"}
    samples: list[tuple[str, float, dict[str, str]]] = [
        ("tenant_output_tokens", 100.0, {**chat, "tenant": "acme"}),
        ("tenant_output_tokens", 20.0, {**chat, "tenant": "beta"}),
        ("tenant_prompt_tokens", 30.0, {**chat, "tenant": "acme"}),
        ("generation_queue_wait_ms", 12.0, {**chat, "priority": "0"}),
        ("generation_queue_wait_ms", 900.0, {**chat, "priority": "2"}),
        ("preemptions", 3.0, chat),
        ("yields", 2.0, chat),
        ("resumptions", 5.0, chat),
        ("kv_kept", 4.0, chat),
        ("kv_recomputed", 1.0, chat),
        ("tenant_counter_gap", 42.0, chat),
        ("output_tokens", 120.0, chat),
    ]
    await _report(metrics, "model-pool", samples, sent=len(samples))
    config = tmp_path / "loadmaster.yaml"
    config.write_text(f"metrics:\n  http_host: 127.0.0.1\n  http_port: {metrics.http_port}\n")
    runner = CliRunner()
    as_json = await asyncio.to_thread(
        runner.invoke, app, ["top", "-c", str(config), "--json", "--summary", "10"]
    )
    assert as_json.exit_code == 0, as_json.output
    summary = json.loads(as_json.output)["generative"]["tiny-chat"]["summary"]
    assert summary["tenants"] == {
        "acme": {"output_tokens_per_s": 10.0, "prompt_tokens_per_s": 3.0},
        "beta": {"output_tokens_per_s": 2.0},
    }
    assert summary["wait_to_first_token_by_priority"]["0"]["p50_ms"] == 12.0
    assert (summary["preemptions"], summary["yields"], summary["resumptions"]) == (3, 2, 5)
    assert (summary["kv_kept"], summary["kv_recomputed"], summary["tenant_counter_gap"]) == (4, 1, 42.0)
    frame = await asyncio.to_thread(
        runner.invoke, app, ["top", "-c", str(config), "--once", "--summary", "10"], terminal_width=220
    )
    assert frame.exit_code == 0, frame.output
    assert "generation scheduling" in frame.output
    (row,) = [line for line in frame.output.splitlines() if "acme:10" in line]
    assert "3/2/5" in row and "4/1" in row and "p0:12" in row, row

    url = f"http://127.0.0.1:{metrics.http_port}/metrics"
    scraped = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
    for line in (
        'loadmaster_model_pool_tenant_output_tokens_total{model="tiny-chat",replica="model-pool-1",tenant="acme"} 100.0',
        'loadmaster_model_pool_tenant_prompt_tokens_total{model="tiny-chat",replica="model-pool-1",tenant="acme"} 30.0',
        'loadmaster_model_pool_yields_total{model="tiny-chat",replica="model-pool-1"} 2.0',
        'loadmaster_model_pool_kv_recomputed_total{model="tiny-chat",replica="model-pool-1"} 1.0',
        'loadmaster_model_pool_tenant_counter_gap{model="tiny-chat",replica="model-pool-1"} 42.0',
        'loadmaster_model_pool_generation_queue_wait_seconds_count{model="tiny-chat",priority="2",replica="model-pool-1"} 1.0',
    ):
        assert line in scraped, line
