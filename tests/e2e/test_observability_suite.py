"""Observability against the running suite under traffic: the dashboard in headless Chromium
(DOM and screenshot), `loadmaster top`, the client's `on_metric`, per-model statistics and the
Prometheus exposition."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadmaster.cli.launcher import Suite
from loadmaster.client import Connection, MetricSample, on_metric
from loadmaster.common.errors import LoadmasterError
from loadmaster.v1 import metrics_pb2, metrics_pb2_grpc

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1400,1700",
)
TRAFFIC_WARMUP_S = 6.0


class Traffic:
    """Load on the suite from a few client threads until the block ends: steady `double` and
    `policy` calls, and bursts of `sleep` calls with a deadline shorter than the queue wait, so
    some expire (deadline misses). Bounded: every call has a timeout, threads stop on exit."""

    def __init__(self, edge: str) -> None:
        self._edge = edge
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._steady, args=("double", {"x": np.arange(16, dtype=np.float32)}, 0.004)
            ),
            threading.Thread(
                target=self._steady, args=("policy", {"state": np.zeros((1, 32), np.float32)}, 0.01)
            ),
            threading.Thread(target=self._bursts),
        ]
        self.ok = 0
        self.failed = 0

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.daemon = True
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(15)

    def _steady(self, model_id: str, inputs: dict[str, np.ndarray], pause_s: float) -> None:
        with Connection(self._edge) as conn:
            model = conn.model(model_id)
            while not self._stop.is_set():
                try:
                    model.infer(timeout_ms=5000, **inputs)
                    self.ok += 1
                except LoadmasterError:
                    self.failed += 1
                self._stop.wait(pause_s)

    def _bursts(self) -> None:
        with Connection(self._edge) as conn:
            model = conn.model("sleep")
            while not self._stop.is_set():
                for _ in range(10):  # 4 run at once (max_inflight), the rest wait past 40 ms
                    model.observe(timeout_ms=40, ms=np.array([30.0], dtype=np.float32))
                for _ in range(10):
                    try:
                        if model.get_result(timeout_ms=3000) is not None:
                            self.ok += 1
                    except LoadmasterError:
                        self.failed += 1
                self._stop.wait(0.3)


@pytest.fixture(scope="module")
def traffic(suite: Suite) -> Iterator[Traffic]:
    with Traffic(suite.settings.gateway.edge.bind) as load:
        time.sleep(TRAFFIC_WARMUP_S)  # let the charts' first seconds fill
        yield load
    assert load.ok > 0


def chromium() -> str | None:
    return shutil.which("chromium") or (os.path.exists("/usr/bin/chromium") and "/usr/bin/chromium") or None


def run_chromium(url: str, *extra: str, timeout_s: float = 60.0) -> str:
    """Run headless Chromium once on `url` with a fresh profile; returns its stdout."""
    binary = chromium()
    assert binary is not None
    with tempfile.TemporaryDirectory(prefix="lm-chromium-") as profile:
        process = subprocess.Popen(
            [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra, url],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            out, _ = process.communicate(timeout=timeout_s)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return out.decode(errors="replace")


def color_columns(image: Any, rgb: tuple[int, int, int], tolerance: int = 10) -> int:
    """How many x columns of the image hold a pixel of (about) this color."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    close = (np.abs(pixels - np.array(rgb, dtype=np.int16)) <= tolerance).all(axis=2)
    return int(close.any(axis=0).sum())


@pytest.mark.skipif(chromium() is None, reason="Debian's chromium is not installed (`make chromium`)")
def test_dashboard_shows_live_data_in_headless_chromium(
    suite: Suite, traffic: Traffic, tmp_path: Path
) -> None:
    from PIL import Image

    url = f"http://127.0.0.1:{suite.settings.metrics.http_port}/?window_s=30"
    # virtual time lets the page's one-second refresh run several times within the budget
    dom = run_chromium(url, "--virtual-time-budget=4000", "--dump-dom")
    assert 'class="status ok"' in dom, dom[:2000]
    updates = int(dom.split('data-updates="', 1)[1].split('"', 1)[0])
    assert updates >= 2, "the page did not refresh"
    for chart in ("chart-throughput", "chart-queue", "chart-gpu", "chart-latency-double"):
        tag = dom.split(f'id="{chart}"', 1)[1].split(">", 1)[0]
        points = int(tag.split('data-points="', 1)[1].split('"', 1)[0])
        assert points > 0, f"{chart} drew nothing: {tag}"
    throughput = dom.split('id="chart-throughput"', 1)[1].split(">", 1)[0]
    assert {"double", "policy", "sleep"} <= set(
        throughput.split('data-series="', 1)[1].split('"', 1)[0].split(",")
    )
    summary = dom.split('<table id="summary">', 1)[1].split("</table>", 1)[0]
    assert 'data-model="double"' in summary and 'data-model="policy"' in summary
    assert 'data-state="READY"' in dom  # model states per worker

    screenshot = tmp_path / "dashboard.png"
    run_chromium(url, "--virtual-time-budget=4000", f"--screenshot={screenshot}")
    image = Image.open(screenshot)
    assert image.size[0] >= 1000
    # The first model's lines (#4e9af1, throughput and queue charts) and the p99 lines (#e0525a)
    # span much of the plots' width; legend swatches and text alone cover a few columns.
    assert color_columns(image, (0x4E, 0x9A, 0xF1)) > 150
    assert color_columns(image, (0xE0, 0x52, 0x5A)) > 150
    # LOADMASTER_DASHBOARD_SCREENSHOT=path keeps this screenshot (e.g. to refresh docs/dashboard.png)
    if os.environ.get("LOADMASTER_DASHBOARD_SCREENSHOT"):
        shutil.copy(screenshot, os.environ["LOADMASTER_DASHBOARD_SCREENSHOT"])


def test_loadmaster_top_renders_the_suite(suite: Suite, traffic: Traffic) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "loadmaster.cli.main", "top", "--config", str(suite.config_path), "--once"],
        env={**suite.env, "COLUMNS": "160"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for expected in ("double", "policy", "READY", "req/s", "p99"):
        assert expected in out, out


def test_on_metric_streams_live_gateway_samples(suite: Suite, traffic: Traffic) -> None:
    got: list[MetricSample] = []
    enough = threading.Event()

    def collect(sample: MetricSample) -> None:
        got.append(sample)
        if len(got) >= 5:
            enough.set()

    with on_metric(
        collect, address=suite.settings.metrics.address, names=["e2e_latency_ms"], labels={"model": "double"}
    ) as subscription:
        assert subscription.wait_ready(10)
        assert enough.wait(15), f"only {len(got)} samples"
    assert all(s.labels["service"] == "gateway" and s.labels["model"] == "double" for s in got)
    assert all(s.value > 0 for s in got)


def test_model_statistics_and_prometheus_reflect_the_traffic(suite: Suite, traffic: Traffic) -> None:
    with grpc.insecure_channel(suite.settings.metrics.address) as channel:
        stub = metrics_pb2_grpc.MetricsServiceStub(channel)
        reply = stub.GetModelStatistics(metrics_pb2.GetModelStatisticsRequest(model_id="double"), timeout=5)
    [double] = reply.models
    assert double.success_count > 10
    assert double.success.count >= double.success_count - 5 and double.success.total_ms > 0
    assert double.queue.count > 0 and double.compute.count > 0
    assert double.execution_count > 0 and sum(b.count for b in double.batch_stats) > 0
    assert double.last_inference_unix_ns > 0

    text = httpx.get(f"http://127.0.0.1:{suite.settings.metrics.http_port}/metrics", timeout=5).text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    latency = families["loadmaster_gateway_e2e_latency_seconds"]
    assert latency.type == "histogram"
    counts = [
        s.value for s in latency.samples if s.name.endswith("_count") and s.labels.get("model") == "double"
    ]
    assert counts and sum(counts) > 10
    assert "loadmaster_scheduler_scheduling_wait_seconds" in families
    assert "loadmaster_model_pool_inference_latency_seconds" in families
