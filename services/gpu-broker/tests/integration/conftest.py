"""Brokers on 127.0.0.1:0 over the session's real Redis, each test under its own key prefix.

`make_settings(**gpu_broker_fields)` gives settings for the test's prefix; `start_broker(settings,
clock)` builds and starts a broker and returns it with a stub; every broker stops at teardown.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from loadmaster.common.clock import Clock
from loadmaster.common.config import GpuBrokerSettings, GpuSpec, MetricsSettings, Settings
from loadmaster.common.grpc_server import GrpcServer
from loadmaster.gpu_broker.server import build
from loadmaster.v1 import gpu_broker_pb2_grpc

# Node n1: GPU 0 with 10_000 MB and GPU 1 with 6_000 MB, no reserve (tests count exactly).
DECLARED = {"n1": [GpuSpec(index=0, total_mb=10_000), GpuSpec(index=1, total_mb=6_000)]}


@dataclass
class Broker:
    server: GrpcServer
    stub: gpu_broker_pb2_grpc.GpuBrokerServiceStub


@pytest.fixture
def make_settings(redis_url: str) -> Callable[..., Settings]:
    prefix = f"test-{uuid.uuid4().hex[:12]}"

    def make(*, redis: str | None = None, **broker: Any) -> Settings:
        fields: dict[str, Any] = {
            "listen": "127.0.0.1:0",
            "key_prefix": prefix,
            "use_nvml": False,
            "reserve_mb": 0,
            "lease_ttl_s": 30.0,
            "declared": DECLARED,
        }
        fields.update(broker)
        return Settings(
            redis_url=redis or redis_url,
            gpu_broker=GpuBrokerSettings(**fields),
            metrics=MetricsSettings(enabled=False),
        )

    return make


@pytest.fixture
async def start_broker() -> AsyncIterator[Callable[..., Awaitable[Broker]]]:
    async with contextlib.AsyncExitStack() as stack:

        async def start(settings: Settings, clock: Clock | None = None) -> Broker:
            server = await build(settings, clock=clock)
            port = await server.start()
            stack.push_async_callback(server.stop)
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
            return Broker(server, gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel))

        yield start
