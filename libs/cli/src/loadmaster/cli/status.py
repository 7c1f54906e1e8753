"""What `loadmaster status` shows: each service's health and each model's state per worker."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from loadmaster.common.config import Settings
from loadmaster.common.grpc_client import aio_channel, check_health
from loadmaster.v1 import model_pool_pb2, scheduler_pb2, scheduler_pb2_grpc

__all__ = ["ModelRow", "ServiceRow", "SuiteStatus", "collect_status"]


@dataclass(frozen=True, slots=True)
class ServiceRow:
    name: str
    address: str
    serving: bool


@dataclass(frozen=True, slots=True)
class ModelRow:
    worker_id: str
    model_id: str
    state: str
    inflight: int
    device: str
    vram_mb: int
    error: str


@dataclass(frozen=True, slots=True)
class SuiteStatus:
    services: list[ServiceRow]
    models: list[ModelRow]

    @property
    def healthy(self) -> bool:
        return all(row.serving for row in self.services)


def _state_name(state: int) -> str:
    return model_pool_pb2.ModelState.Name(state).removeprefix("MODEL_STATE_")  # type: ignore[arg-type]


async def _health(name: str, address: str, timeout_s: float) -> ServiceRow:
    async with aio_channel(address) as channel:
        return ServiceRow(name, address, await check_health(channel, timeout_s=timeout_s))


async def _models(address: str, timeout_s: float) -> list[ModelRow]:
    async with aio_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        try:
            reply = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return []
    return [
        ModelRow(
            worker.worker_id,
            slot.model_id,
            _state_name(slot.state),
            slot.inflight,
            slot.device,
            slot.vram_mb,
            slot.error,
        )
        for worker in reply.workers
        for slot in worker.models
    ]


async def collect_status(settings: Settings, *, timeout_s: float = 1.0) -> SuiteStatus:
    checks = [
        ("gpu-broker", settings.gpu_broker.address),
        ("metrics", settings.metrics.address),
        ("scheduler", settings.scheduler.address),
        ("model-pool", settings.model_pool.address),
        ("gateway", settings.gateway.address),
    ]
    rows = await asyncio.gather(*(_health(name, address, timeout_s) for name, address in checks))
    models = await _models(settings.scheduler.address, timeout_s)
    return SuiteStatus(list(rows), models)
