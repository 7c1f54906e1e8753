"""Two workers and two gateways report through real reporters: the scrape tells them apart,
every reporter's process appears with its build, and error counters exist before any error."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.metrics.server import MetricsServer

Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(server: MetricsServer) -> Scrape:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}", trust_env=False) as client:
        response = await client.get("/metrics", timeout=5.0)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


async def test_replicas_are_told_apart_in_the_scrape(server: MetricsServer) -> None:
    address = f"127.0.0.1:{server.port}"
    reporters = [
        TelemetryReporter(service, replica, address, flush_interval_s=0.01)
        for service, replica in (
            ("model-pool", "w-1"),
            ("model-pool", "w-2"),
            ("gateway", "gw-a"),
            ("gateway", "gw-b"),
        )
    ]
    for reporter in reporters:
        reporter.start()
    w1, w2, gw_a, gw_b = reporters
    # `classifier` unloaded on w-1 only; each worker holds its own memory.
    w1.record("slot_state", 1.0, {"model": "classifier", "state": "idle"})
    w2.record("slot_state", 1.0, {"model": "classifier", "state": "ready"})
    w1.record("worker_leased_mb", 112.0, {"gpu": "0"})
    w2.record("worker_leased_mb", 368.0, {"gpu": "0"})
    # Traffic on one gateway only.
    for _ in range(3):
        gw_a.record("requests", 1.0, {"model": "double", "code": "ok"})
    gw_b.record("e2e_latency_ms", 1.0, {"model": "double", "code": "ok"})
    for reporter in reporters:
        await reporter.close(timeout_s=10.0)

    seen = await scrape(server)
    state = "loadmaster_model_pool_slot_state"
    assert seen[(state, (("model", "classifier"), ("replica", "w-1"), ("state", "idle")))] == 1.0
    assert seen[(state, (("model", "classifier"), ("replica", "w-2"), ("state", "ready")))] == 1.0
    leased = "loadmaster_model_pool_worker_leased_bytes"
    assert seen[(leased, (("gpu", "0"), ("replica", "w-1")))] == 112 * 2**20
    assert seen[(leased, (("gpu", "0"), ("replica", "w-2")))] == 368 * 2**20
    requests = "loadmaster_gateway_requests_total"
    assert seen[(requests, (("code", "ok"), ("model", "double"), ("replica", "gw-a")))] == 3
    assert (
        seen[(requests, (("code", "ok"), ("model", "double"), ("replica", "gw-b")))] == 0
    )  # at 0, not absent
    assert seen[(requests, (("code", "internal"), ("model", "double"), ("replica", "gw-a")))] == 0

    for service, replica in (
        ("model_pool", "w-1"),
        ("model_pool", "w-2"),
        ("gateway", "gw-a"),
        ("gateway", "gw-b"),
    ):
        labels = {"service": service.replace("_", "-"), "replica": replica}
        rss = seen[("loadmaster_process_resident_memory_bytes", tuple(sorted(labels.items())))]
        assert rss > 10 * 2**20
        [build] = [
            value
            for (name, lbls), value in seen.items()
            if name == "loadmaster_build_info" and {k: v for k, v in lbls if k in labels} == labels
        ]
        assert build == 1.0
    versions = {dict(lbls)["version"] for name, lbls in seen if name == "loadmaster_build_info"}
    assert versions == {"0.1.0"}
