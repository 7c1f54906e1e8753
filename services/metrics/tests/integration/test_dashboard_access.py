"""The metrics HTTP endpoints take the gateway's API keys (issue 25): with keys configured, the
dashboard, its data and /metrics need one (Bearer, or as the Basic password a browser sends);
/healthz stays open; a refusal is logged with the caller's address."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import urllib.error
from collections.abc import AsyncIterator

import httpx
import pytest

from loadmaster.common.config import MetricsSettings, Settings
from loadmaster.common.gateway_config import ApiKeySettings, AuthSettings, GatewaySettings
from loadmaster.metrics.server import MetricsServer, build

KEY = "lm_dashboard-reader"
PATHS = ("/", "/api/dashboard", "/metrics")


@pytest.fixture
async def guarded() -> AsyncIterator[MetricsServer]:
    settings = Settings(
        metrics=MetricsSettings(address="127.0.0.1:0", http_host="127.0.0.1", http_port=0, ring_size=1000),
        gateway=GatewaySettings(
            auth=AuthSettings(
                api_keys=[ApiKeySettings(name="reader", sha256=hashlib.sha256(KEY.encode()).hexdigest())]
            )
        ),
    )
    server = await build(settings)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def test_without_a_key_every_page_but_healthz_is_refused(
    guarded: MetricsServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{guarded.http_port}", timeout=5) as http:
        for path in PATHS:
            reply = await http.get(path)
            assert reply.status_code == 401, (path, reply.text)
            assert reply.headers["www-authenticate"].startswith("Basic")
        wrong = await http.get("/api/dashboard", headers={"Authorization": "Bearer lm_guessed"})
        assert wrong.status_code == 401
        assert (await http.get("/healthz")).status_code == 200
    refusals = [
        r.getMessage()
        for r in caplog.records
        if "refused GET /api/dashboard from 127.0.0.1" in r.getMessage()
    ]
    assert refusals, caplog.text


async def test_a_gateway_key_opens_the_dashboard_as_bearer_or_basic_password(guarded: MetricsServer) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{guarded.http_port}", timeout=5) as http:
        for path in PATHS:
            bearer = await http.get(path, headers={"Authorization": f"Bearer {KEY}"})
            assert bearer.status_code == 200, (path, bearer.text)
            basic = await http.get(path, auth=("anyone", KEY))
            assert basic.status_code == 200, (path, basic.text)


async def test_loadmaster_top_sends_its_api_key(guarded: MetricsServer) -> None:
    top_cmd = pytest.importorskip("loadmaster.cli.top_cmd")
    url = f"http://127.0.0.1:{guarded.http_port}/api/dashboard?window_s=10&step_s=1&summary_s=5"
    doc = await asyncio.to_thread(top_cmd.fetch_dashboard, url, api_key=KEY)
    assert isinstance(doc, dict)
    with pytest.raises(urllib.error.HTTPError) as refused:
        await asyncio.to_thread(top_cmd.fetch_dashboard, url)
    assert refused.value.code == 401
