"""The metrics service in-process on 127.0.0.1:0, and a gRPC stub to it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from loadmaster.common.config import MetricsSettings, Settings
from loadmaster.common.grpc_client import aio_channel
from loadmaster.metrics.server import MetricsServer, build
from loadmaster.v1 import metrics_pb2_grpc


@pytest.fixture
def metrics_settings() -> Settings:
    return Settings(
        metrics=MetricsSettings(address="127.0.0.1:0", http_host="127.0.0.1", http_port=0, ring_size=1000)
    )


@pytest.fixture
async def server(metrics_settings: Settings) -> AsyncIterator[MetricsServer]:
    server = await build(metrics_settings)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def stub(server: MetricsServer) -> AsyncIterator[metrics_pb2_grpc.MetricsServiceStub]:
    async with aio_channel(f"127.0.0.1:{server.port}") as channel:
        yield metrics_pb2_grpc.MetricsServiceStub(channel)
