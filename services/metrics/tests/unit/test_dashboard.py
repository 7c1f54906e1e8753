from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry

from loadmaster.common.clock import FakeClock
from loadmaster.metrics.dashboard import SlotRow, WorkerRow, snapshot
from loadmaster.metrics.dashboard_routes import dashboard_routes
from loadmaster.metrics.exposition import Exposition
from loadmaster.metrics.http import create_app
from loadmaster.metrics.windows import Sample, Windows, label_set, observations_of


def sample(name: str, value: float, service: str, **labels: str) -> Sample:
    return Sample(name, value, label_set(labels, service=service))


def loaded_windows() -> tuple[FakeClock, Windows]:
    clock = FakeClock()
    windows = Windows(ring_size=1000, clock=clock)
    windows.ingest(observations_of([sample("queue_depth", 3, "scheduler", model="double")]))
    for second in range(5):  # 5 s of traffic: 4 requests/s, latencies 1..4 ms, one expired each second
        batch = [sample("requests", 1, "gateway", model="double", code="ok") for _ in range(3)]
        batch.append(sample("requests", 1, "gateway", model="double", code="expired"))
        batch += [sample("e2e_latency_ms", v, "gateway", model="double", code="ok") for v in (1, 2, 3, 4)]
        batch.append(sample("lease_mb", 100 + second, "gpu-broker", node="local", gpu="0"))
        batch.append(sample("free_mb", 900 - second, "gpu-broker", node="local", gpu="0"))
        if second == 2:  # the queue filled and drained within one bucket
            batch += [
                sample("queue_depth", 7, "scheduler", model="double"),
                sample("queue_depth", 2, "scheduler", model="double"),
            ]
        windows.ingest(observations_of(batch))
        clock.advance(1.0)
    windows.ingest(observations_of([sample("queue_depth", 0, "scheduler", model="double")]))
    windows.ingest(observations_of([sample("slot_state", 1, "model-pool", model="double", state="ready")]))
    windows.ingest(observations_of([sample("requests", 1, "gateway", model="(unknown)", code="not_found")]))
    return clock, windows


def test_snapshot_buckets_latency_throughput_misses_queue_and_gpu() -> None:
    _, windows = loaded_windows()

    doc = snapshot(windows, window_s=10, step_s=1, summary_s=10)

    assert len(doc["t"]) == 10 and doc["t"][-1] == 0.0
    assert list(doc["models"]) == ["double"]  # "(unknown)" is not a model
    double = doc["models"]["double"]
    assert double["throughput_rps"][4:9] == [4.0] * 5
    assert double["throughput_rps"][:4] == [0.0] * 4
    assert double["deadline_misses_per_s"][4:9] == [1.0] * 5
    assert double["p50"][4] == 2.5 and double["p99"][4] == pytest.approx(3.97)
    assert double["p50"][0] is None
    # the gauge is carried forward, with the peak of a bucket that saw several readings
    assert double["queue_depth"][3] is None
    assert double["queue_depth"][4:10] == [3.0, 3.0, 7.0, 2.0, 2.0, 0.0]
    assert double["summary"] == {
        "p50_ms": 2.5,
        "p95_ms": 4.0,
        "p99_ms": 4.0,
        "throughput_rps": 2.0,
        "errors": 5,
        "deadline_misses": 5,
        "queue_depth": 0.0,
    }
    gpu = doc["gpus"]["local/gpu0"]
    assert gpu["lease_mb"][4:9] == [100.0, 101.0, 102.0, 103.0, 104.0] and gpu["lease_mb_now"] == 104.0
    assert gpu["free_mb_now"] == 896.0
    assert doc["workers"] == [
        {
            "worker_id": "model-pool",
            "slots": [{"model": "double", "state": "READY", "inflight": 0, "vram_mb": 0}],
        }
    ]


def test_generative_models_get_tokens_per_second_and_time_to_first_token() -> None:
    clock = FakeClock()
    windows = Windows(ring_size=1000, clock=clock)
    for _ in range(4):  # 50 tokens/s; first tokens after 10 and 30 ms
        windows.ingest(
            observations_of(
                [
                    sample("output_tokens", 20, "model-pool", model="tiny-chat"),
                    sample("output_tokens", 30, "model-pool", model="tiny-chat"),
                    sample("time_to_first_token_ms", 10, "gateway", model="tiny-chat"),
                    sample("time_to_first_token_ms", 30, "gateway", model="tiny-chat"),
                ]
            )
        )
        clock.advance(1.0)

    doc = snapshot(windows, window_s=6, step_s=1, summary_s=4)

    chat = doc["generative"]["tiny-chat"]
    assert chat["tokens_per_s"][1:5] == [50.0] * 4 and chat["tokens_per_s"][0] == 0.0
    assert chat["ttft_p50_ms"][1:5] == [20.0] * 4 and chat["ttft_p95_ms"][1] == pytest.approx(29.0)
    summary = chat["summary"]
    assert {k: summary[k] for k in ("tokens_per_s", "ttft_p50_ms", "ttft_p95_ms")} == {
        "tokens_per_s": 50.0,
        "ttft_p50_ms": 20.0,
        "ttft_p95_ms": 30.0,
    }
    # no scheduling figures were reported: none are made up
    assert summary["tenants"] == {} and summary["wait_to_first_token_by_priority"] == {}
    assert summary["preemptions"] == 0 and summary["tenant_counter_gap"] is None
    assert doc["models"] == {}  # no tensor traffic


def test_scheduler_workers_win_over_slot_samples_and_bad_windows_are_refused() -> None:
    _, windows = loaded_windows()
    rows = [WorkerRow("w1", (SlotRow("double", "LOADING", 1, 16),))]
    doc = snapshot(windows, workers=rows)
    assert doc["workers"][0]["worker_id"] == "w1" and doc["workers"][0]["slots"][0]["state"] == "LOADING"
    for bad in ({"window_s": 0}, {"step_s": -1}, {"window_s": 1e9, "step_s": 1}, {"summary_s": float("nan")}):
        with pytest.raises(ValueError):
            snapshot(windows, **bad)


async def test_routes_serve_the_page_its_files_and_the_json() -> None:
    _, windows = loaded_windows()

    async def no_scheduler() -> None:
        return None

    app = create_app(Exposition(CollectorRegistry()), routes=dashboard_routes(windows, workers=no_scheduler))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://m") as client:
        page = await client.get("/")
        assert page.status_code == 200 and "/static/dashboard.js" in page.text
        script = await client.get("/static/dashboard.js")
        assert script.headers["content-type"].startswith("text/javascript") and "drawChart" in script.text
        assert (await client.get("/static/dashboard.css")).status_code == 200
        assert (await client.get("/static/nope.js")).status_code == 404
        data = (await client.get("/api/dashboard", params={"window_s": 10})).json()
        assert data["models"]["double"]["summary"]["deadline_misses"] == 5
        bad = await client.get("/api/dashboard", params={"step_s": "x"})
        assert bad.status_code == 400 and "step_s" in bad.json()["error"]
        assert (await client.get("/api/dashboard", params={"window_s": "-5"})).status_code == 400


async def test_documents_are_cached_briefly() -> None:
    clock, windows = loaded_windows()

    async def no_scheduler() -> None:
        return None

    app = create_app(
        Exposition(CollectorRegistry()), routes=dashboard_routes(windows, workers=no_scheduler, cache_s=0.5)
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://m") as client:

        async def errors() -> int:
            return (await client.get("/api/dashboard")).json()["models"]["double"]["summary"]["errors"]

        assert await errors() == 5
        windows.ingest(observations_of([sample("requests", 1, "gateway", model="double", code="internal")]))
        assert await errors() == 5  # the cached document
        clock.advance(0.6)
        assert await errors() == 6
