from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette

from loadmaster.metrics.exposition import Exposition
from loadmaster.metrics.http import create_app
from loadmaster.metrics.windows import Sample, label_set, observations_of


async def get(app: Starlette, path: str, **headers: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://metrics") as client:
        return await client.get(path, headers=headers)


async def test_metrics_and_healthz() -> None:
    exposition = Exposition(CollectorRegistry())
    exposition.observe(
        observations_of([Sample("send_errors", 2.0, label_set({"service": "gateway"}))]),
        service="gateway",
        replica="gw-1",
    )
    serving = True
    app = create_app(exposition, serving=lambda: serving)

    response = await get(app, "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert 'loadmaster_gateway_send_errors_total{replica="gw-1"} 2.0' in response.text

    openmetrics = await get(app, "/metrics", accept="application/openmetrics-text")
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")

    assert (await get(app, "/healthz")).json() == {"status": "SERVING"}
    serving = False
    assert (await get(app, "/healthz")).status_code == 503
