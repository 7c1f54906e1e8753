"""Wiring of one model-pool worker: pool, gRPC servicer, data port, scheduler session.

    server = await build(settings)          # wired, not started
    port = await server.start()             # gRPC port; then engines, data port, session, preload
    server.data_endpoint, server.worker_id  # what the scheduler and gateways are told
    await server.stop()                     # refuse new work, drain, unload, release, close
                                            # (within model_pool.shutdown_grace_s)

`python -m loadmaster.model_pool` runs the same thing until SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from loadmaster.common.admin_store import watch_settings
from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.config import Settings
from loadmaster.common.errors import LoadmasterError
from loadmaster.common.grpc_server import GrpcServer
from loadmaster.common.service import default_instance_id
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.common.tensors import TensorLimits
from loadmaster.model_pool.data_port import DataPort, advertised_endpoint
from loadmaster.model_pool.engines import engine_class
from loadmaster.model_pool.generation_order import OrderPolicy
from loadmaster.model_pool.images import ImageLimits
from loadmaster.model_pool.leases import AsyncLeaseClient, LeaseClient
from loadmaster.model_pool.pool import ModelPool
from loadmaster.model_pool.repository import ModelRepository
from loadmaster.model_pool.servicer import ModelPoolServiceServicer
from loadmaster.model_pool.worker_session import WorkerIdentity, WorkerSession
from loadmaster.v1 import model_pool_pb2, model_pool_pb2_grpc

__all__ = ["ModelPoolServer", "advertised_grpc_endpoint", "build"]

log = logging.getLogger(__name__)

_WILDCARD_HOSTS = {"0.0.0.0", "::", "[::]", "*", ""}
PRELOAD_BROKER_WAIT_S = 30.0  # how long preloading waits for the gpu-broker to be reachable


def advertised_grpc_endpoint(
    address: str, listen: str | None, port: int, *, hostname: str | None = None
) -> str:
    """`host:port` others use for this worker's gRPC: the bound port, and the host name
    when bound to a wildcard (a shared `address` may name a load balancer, not this worker)."""
    host = (listen or address).rpartition(":")[0]
    if host in _WILDCARD_HOSTS:
        host = hostname or socket.gethostname()
    return f"{host}:{port}"


class ModelPoolServer(GrpcServer):
    """The worker's gRPC server plus everything it starts and stops with it."""

    def __init__(
        self,
        settings: Settings,
        *,
        clock: Clock,
        lease_client: LeaseClient | None,
    ) -> None:
        pool_settings = settings.model_pool
        super().__init__("model-pool", pool_settings.listen_address, grace_s=pool_settings.shutdown_grace_s)
        self.settings = settings
        self.worker_id = pool_settings.worker_id or default_instance_id()
        self.data_endpoint = ""  # known once started
        self.grpc_endpoint = ""
        self._clock = clock
        self._owns_lease_client = lease_client is None

        def broker_client() -> LeaseClient:
            return AsyncLeaseClient(
                settings.gpu_broker.address, holder=self.worker_id, node=pool_settings.node
            )

        self.lease_client: LeaseClient = lease_client or broker_client()
        self.telemetry = TelemetryReporter(
            "model-pool",
            self.worker_id,
            settings.metrics.address if settings.metrics.enabled else None,
            loop_lag_tick_s=settings.metrics.loop_lag_tick_ms / 1000,
        )
        self.pool = ModelPool(
            ModelRepository(settings.repository_path),
            models=settings.models,
            lease_client=self.lease_client,
            device=pool_settings.device,
            threads=pool_settings.inference_threads,
            lease_ttl_s=pool_settings.lease_ttl_s,
            clock=clock,
            metrics=self.telemetry,
            eviction_wait_s=pool_settings.eviction_wait_s,
            warm_bump_s=(pool_settings.warm_bump_max_ms / 1000.0, pool_settings.warm_bump_idle_ms / 1000.0),
            allow_split=pool_settings.allow_split,
            order_policy=OrderPolicy(
                fairness=settings.generation.fairness,
                timeslice_tokens=settings.generation.timeslice_tokens,
                promote_after_s=settings.generation.promote_after_s,
            ),
            # The keeper's thread renews over a channel of its own (None: an injected double).
            renewal_client=broker_client if lease_client is None else None,
        )
        limits = settings.gateway.limits
        tensor_limits = TensorLimits(
            max_payload_bytes=limits.max_payload_bytes,
            max_tensors=limits.max_tensors,
            max_dims=limits.max_dims,
            max_image_pixels=limits.max_image_pixels,
        )
        image_limits = ImageLimits(max_pixels=limits.max_image_pixels, max_scans=limits.max_image_scans)
        self.data_port = DataPort(
            self.pool,
            bind=pool_settings.data_bind,
            worker_id=self.worker_id,
            limits=tensor_limits,
            clock=clock,
            metrics=self.telemetry,
            image_limits=image_limits,
            image_threads=pool_settings.image_decode_threads,
            image_decode_ms=limits.max_image_decode_ms,
            local_link=pool_settings.local_link,
        )
        self.session: WorkerSession | None = None
        # Pins and keep-alive changed at run time (docs/admin.md), applied as they come.
        self.runtime = watch_settings(
            settings, lambda merged: self.pool.use_models(merged.models), warn=("models.known.",)
        )
        servicer = ModelPoolServiceServicer(
            self.pool,
            worker_id=self.worker_id,
            data_endpoint=lambda: self.data_endpoint,
            limits=tensor_limits,
            image_limits=image_limits,
        )
        self.add_service(
            model_pool_pb2.DESCRIPTOR.services_by_name["ModelPoolService"].full_name,
            model_pool_pb2_grpc.add_ModelPoolServiceServicer_to_server,
            servicer,
        )
        self.on_start(self._started)
        self.on_drain(self._draining_hook)
        self.on_stop(self._stopping_hook)

    async def _started(self) -> None:
        pool_settings = self.settings.model_pool
        self.telemetry.start()
        if self.runtime is not None:
            await self.runtime.start()  # stored pins hold from the first load
        import_engines(self.pool.repository, pool_settings.preload)
        last_endpoint = await self.data_port.start()
        self.data_endpoint = advertised_endpoint(last_endpoint, configured=pool_settings.data_endpoint)
        assert self.port is not None
        self.grpc_endpoint = advertised_grpc_endpoint(pool_settings.address, pool_settings.listen, self.port)
        self.session = WorkerSession(
            self.settings.scheduler.address,
            self.pool,
            identity=WorkerIdentity(
                worker_id=self.worker_id,
                data_endpoint=self.data_endpoint,
                grpc_endpoint=self.grpc_endpoint,
                node=pool_settings.node,
            ),
            generations=self.data_port.generations,
            clock=self._clock,
        )
        self.session.start()
        log.info(
            "worker %s: data %s, grpc %s, repository %s",
            self.worker_id,
            self.data_endpoint,
            self.grpc_endpoint,
            self.pool.repository.root,
        )
        await self._preload(pool_settings.preload)

    async def _preload(self, model_ids: list[str]) -> None:
        """Load `model_ids`, once the gpu-broker can be reached: started beside it (`loadmaster
        up` starts every service at once), this worker may be up first."""
        if model_ids and not await self.lease_client.wait_ready(PRELOAD_BROKER_WAIT_S):
            log.warning("gpu-broker not reachable after %.0f s; preloading anyway", PRELOAD_BROKER_WAIT_S)
        results = await asyncio.gather(*(self.pool.load(m) for m in model_ids), return_exceptions=True)
        for model_id, result in zip(model_ids, results, strict=True):
            if isinstance(result, BaseException):
                log.error("preloading %s failed: %s", model_id, getattr(result, "message", result))

    async def _draining_hook(self, grace_left_s: float) -> None:
        # New requests are answered `unavailable` (retryable) while in-flight ones finish; each
        # model's lease is released once its last request is done (or the grace is spent).
        await self.pool.close(timeout_s=max(0.0, grace_left_s - 0.5))
        await self.data_port.stop()

    async def _stopping_hook(self) -> None:
        if self.runtime is not None:
            await self.runtime.close()
        if self.session is not None:
            await self.session.stop()
        if self._owns_lease_client:
            await self.lease_client.close()
        await self.telemetry.close()


def import_engines(repository: ModelRepository, model_ids: list[str]) -> list[str]:
    """Import the engines of `model_ids` now, before the worker serves: a first import holds
    the GIL for a long time (torch's ~2 s), and once the data port is bound, every request of
    the models already READY would wait for it. Returns the backends imported; a model or an
    engine that cannot be had is left for its load to report."""
    backends: set[str] = set()
    for model_id in model_ids:
        try:
            backends.add(repository.spec(model_id).backend)
        except LoadmasterError:
            continue
    imported = []
    for backend in sorted(backends):
        try:
            engine_class(backend)
        except LoadmasterError:
            continue
        imported.append(backend)
    return imported


async def build(
    settings: Settings,
    *,
    clock: Clock | None = None,
    lease_client: LeaseClient | None = None,
) -> ModelPoolServer:
    """The worker, wired and not started (`await server.start()` or `await server.run()`)."""
    return ModelPoolServer(settings, clock=clock or SystemClock(), lease_client=lease_client)
