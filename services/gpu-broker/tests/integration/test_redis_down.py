"""A broker whose Redis is unreachable answers UNAVAILABLE quickly and grants nothing."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

from loadmaster.common.config import Settings
from loadmaster.common.ports import free_port
from loadmaster.v1 import gpu_broker_pb2 as pb

MakeSettings = Callable[..., Settings]
StartBroker = Callable[..., Awaitable[Any]]  # conftest.start_broker -> Broker(server, stub)


async def test_redis_down_is_unavailable(make_settings: MakeSettings, start_broker: StartBroker) -> None:
    settings = make_settings(redis=f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    broker = await start_broker(settings)
    stub = broker.stub
    for call in (
        lambda: stub.Acquire(pb.AcquireRequest(holder="w", mb=100), timeout=10),
        lambda: stub.Inventory(pb.InventoryRequest(), timeout=10),
        lambda: stub.Watch(pb.WatchRequest(), timeout=10).read(),
    ):
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 3
