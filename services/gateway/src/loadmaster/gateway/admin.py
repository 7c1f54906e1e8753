"""Scheduler admin calls the gateway exposes to `admin` keys: queue state and the strategy switch."""

from __future__ import annotations

from typing import Any

import grpc

from loadmaster.common.errors import UnavailableError, from_grpc_error
from loadmaster.common.grpc_client import aio_channel
from loadmaster.common.retry import retry_options
from loadmaster.v1 import scheduler_pb2, scheduler_pb2_grpc

__all__ = ["SchedulerAdmin"]


class SchedulerAdmin:
    def __init__(self, scheduler_address: str, *, timeout_s: float = 5.0) -> None:
        self._address = scheduler_address
        self._timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None

    def _stub(self) -> scheduler_pb2_grpc.SchedulerServiceStub:
        if self._channel is None:
            self._channel = aio_channel(self._address, options=retry_options())
        return scheduler_pb2_grpc.SchedulerServiceStub(self._channel)

    async def queues(self) -> dict[str, Any]:
        try:
            reply = await self._stub().GetQueues(scheduler_pb2.GetQueuesRequest(), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as error:
            raise UnavailableError(f"scheduler unreachable: {error.details() or error.code().name}") from None
        return {
            "strategy": reply.strategy,
            "queues": [
                {
                    "model": q.model_id,
                    "depth": q.depth,
                    "inflight": q.inflight,
                    "credits": q.credits,
                    "expired": q.expired,
                    "overflowed": q.overflowed,
                    "granted": q.granted,
                }
                for q in reply.queues
            ],
        }

    async def set_strategy(self, strategy: str, policy: str = "") -> dict[str, Any]:
        request = scheduler_pb2.SetStrategyRequest(strategy=strategy, policy=policy)
        try:
            reply = await self._stub().SetStrategy(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                raise UnavailableError(f"scheduler unreachable: {error.details()}") from None
            raise from_grpc_error(error) from None
        return {"strategy": reply.strategy, "previous": reply.previous, "moved": reply.moved}

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
