"""Which models exist and in what state, for the v2 model/repository endpoints; load and unload.

The scheduler's `ListWorkers` is the source of truth (every worker, its
repository and its slots). `summarize` turns that into one `ModelView` per
model (pure); `ModelCatalog` makes the gRPC calls: ListWorkers to the
scheduler, Load/Unload to a worker's ModelPool service.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from loadmaster.common.errors import NotFoundError, UnavailableError, from_grpc_error
from loadmaster.common.grpc_client import aio_channel
from loadmaster.common.retry import retry_options
from loadmaster.v1 import model_pool_pb2, model_pool_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

__all__ = ["ModelCatalog", "ModelView", "summarize"]

log = logging.getLogger(__name__)

_READY = model_pool_pb2.MODEL_STATE_READY
_STATE_NAMES = {
    model_pool_pb2.MODEL_STATE_READY: "READY",
    model_pool_pb2.MODEL_STATE_LOADING: "LOADING",
    model_pool_pb2.MODEL_STATE_UNLOADING: "UNLOADING",
    model_pool_pb2.MODEL_STATE_DRAINING: "UNLOADING",
}


@dataclass(frozen=True, slots=True)
class ModelView:
    name: str
    state: str  # READY, LOADING, UNLOADING, UNAVAILABLE (v2 repository index states)
    reason: str = ""
    backend: str = ""
    workers: tuple[str, ...] = ()  # workers that hold it READY
    max_inflight: int = 0
    load_started_unix_ms: int = 0  # LOADING: when the earliest load in progress began
    load_time_ms: float = 0.0  # the last measured load's duration on any worker (0: none)

    @property
    def ready(self) -> bool:
        return self.state == "READY"


def summarize(workers: Iterable[scheduler_pb2.WorkerInfo]) -> dict[str, ModelView]:
    """One view per model any worker can load or holds; READY wins over LOADING over the rest."""
    names: set[str] = set()
    slots: dict[str, list[tuple[str, model_pool_pb2.ModelSlotStatus]]] = {}
    for worker in workers:
        names.update(worker.repository)
        for slot in worker.models:
            names.add(slot.model_id)
            slots.setdefault(slot.model_id, []).append((worker.worker_id, slot))
    views: dict[str, ModelView] = {}
    for name in sorted(names):
        held = slots.get(name, [])
        ready = tuple(worker_id for worker_id, slot in held if slot.state == _READY)
        backend = next((slot.backend for _, slot in held if slot.backend), "")
        if ready:
            max_inflight = sum(slot.max_inflight for _, slot in held if slot.state == _READY)
            views[name] = ModelView(name, "READY", "", backend, ready, max_inflight)
            continue
        states = [_STATE_NAMES.get(slot.state, "UNAVAILABLE") for _, slot in held]
        state = "LOADING" if "LOADING" in states else (states[0] if states else "UNAVAILABLE")
        reason = next((slot.error for _, slot in held if slot.error), "" if held else "not loaded")
        started = [slot.load_started_unix_ms for _, slot in held if slot.load_started_unix_ms]
        measured = [slot.load_time_ms for _, slot in held if slot.load_time_ms > 0]
        views[name] = ModelView(
            name,
            state,
            reason,
            backend,
            load_started_unix_ms=min(started, default=0),
            load_time_ms=max(measured, default=0.0),
        )
    return views


class ModelCatalog:
    """gRPC calls for the model endpoints: ListWorkers, and Load/Unload on a worker."""

    def __init__(
        self, scheduler_address: str, *, timeout_s: float = 5.0, load_timeout_s: float = 120.0
    ) -> None:
        self._scheduler_address = scheduler_address
        self._timeout_s = timeout_s
        self._load_timeout_s = load_timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._worker_channels: dict[str, grpc.aio.Channel] = {}

    async def workers(self) -> list[scheduler_pb2.WorkerInfo]:
        if self._channel is None:
            self._channel = aio_channel(self._scheduler_address, options=retry_options())
        stub = scheduler_pb2_grpc.SchedulerServiceStub(self._channel)
        try:
            reply = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as error:
            raise UnavailableError(f"scheduler unreachable: {error.details() or error.code().name}") from None
        return list(reply.workers)

    async def models(self) -> dict[str, ModelView]:
        return summarize(await self.workers())

    async def model(self, name: str) -> ModelView:
        """The model's view; `NotFoundError` if no worker knows it."""
        view = (await self.models()).get(name)
        if view is None:
            raise NotFoundError(f"model '{name}' is not in any worker's repository")
        return view

    async def load(self, name: str, *, keep_alive_s: float | None = None) -> ModelView:
        """Load `name` on a worker that can (one already holding it first); wait until it is
        READY. `keep_alive_s`: its idle keep-alive from then on (else the configured one)."""
        workers = await self.workers()
        candidates = [w for w in workers if name in w.repository or any(s.model_id == name for s in w.models)]
        if not candidates:
            raise NotFoundError(f"model '{name}' is not in any worker's repository")
        candidates.sort(key=lambda w: (not any(s.model_id == name for s in w.models), len(w.models)))
        worker = candidates[0]
        stub = model_pool_pb2_grpc.ModelPoolServiceStub(self._worker_channel(worker.grpc_endpoint))
        try:
            await stub.Load(
                model_pool_pb2.LoadRequest(model_id=name, keep_alive_s=keep_alive_s),
                timeout=self._load_timeout_s,
            )
        except grpc.aio.AioRpcError as error:
            raise from_grpc_error(error) from None
        return await self.model(name)

    async def unload(self, name: str) -> None:
        """Unload `name` from every worker that holds it."""
        workers = await self.workers()
        if not any(name in w.repository or any(s.model_id == name for s in w.models) for w in workers):
            raise NotFoundError(f"model '{name}' is not in any worker's repository")
        holders = [w for w in workers if any(s.model_id == name for s in w.models)]
        calls = [
            model_pool_pb2_grpc.ModelPoolServiceStub(self._worker_channel(w.grpc_endpoint)).Unload(
                model_pool_pb2.UnloadRequest(model_id=name), timeout=self._load_timeout_s
            )
            for w in holders
        ]
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(outcome, grpc.aio.AioRpcError):
                raise from_grpc_error(outcome)
            if isinstance(outcome, BaseException):
                raise outcome

    async def signature(self, name: str) -> model_pool_pb2.ModelSignature:
        """The model's declared inputs and outputs, from a worker whose repository holds it."""
        holders = [w for w in await self.workers() if name in w.repository]
        if not holders:
            raise NotFoundError(f"model '{name}' is not in any worker's repository")
        stub = model_pool_pb2_grpc.ModelPoolServiceStub(self._worker_channel(holders[0].grpc_endpoint))
        try:
            status = await stub.Status(
                model_pool_pb2.StatusRequest(signatures_of=[name]), timeout=self._timeout_s
            )
        except grpc.aio.AioRpcError as error:
            raise from_grpc_error(error) from None
        for signature in status.signatures:
            if signature.model_id == name:
                return signature
        return model_pool_pb2.ModelSignature(model_id=name)  # its config could not be read

    def _worker_channel(self, endpoint: str) -> grpc.aio.Channel:
        channel = self._worker_channels.get(endpoint)
        if channel is None:
            channel = self._worker_channels[endpoint] = aio_channel(endpoint, options=retry_options())
        return channel

    async def close(self) -> None:
        channels = [*self._worker_channels.values()]
        if self._channel is not None:
            channels.append(self._channel)
        for channel in channels:
            await channel.close()
        self._worker_channels.clear()
        self._channel = None
