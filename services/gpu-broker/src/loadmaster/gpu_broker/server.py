"""Wiring: `build(settings)` returns the broker's gRPC server, not yet started.

Background work (event subscription, inventory registration, reaper, telemetry) starts
in an `on_start` hook and stops in an `on_stop` hook, so `server.start()` / `stop()`
(or `run()`) own the whole lifecycle. The drain hook ends Watch streams first, so the
gRPC grace period is spent only on calls in flight.
"""

from __future__ import annotations

from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.config import Settings
from loadmaster.common.grpc_server import GrpcServer
from loadmaster.common.service import default_instance_id
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.gpu_broker.events import LeaseEventHub
from loadmaster.gpu_broker.inventory import local_inventory
from loadmaster.gpu_broker.manager import LeaseManager
from loadmaster.gpu_broker.nvml import NvmlSampler
from loadmaster.gpu_broker.reaper import LocalGpus, Reaper
from loadmaster.gpu_broker.servicer import GpuBrokerServiceServicer
from loadmaster.gpu_broker.store import RedisLeaseStore, default_replica_ack_timeout_ms
from loadmaster.v1 import gpu_broker_pb2, gpu_broker_pb2_grpc

__all__ = ["SERVICE_NAME", "build"]

SERVICE_NAME = gpu_broker_pb2.DESCRIPTOR.services_by_name["GpuBrokerService"].full_name


async def build(settings: Settings, *, clock: Clock | None = None) -> GrpcServer:
    if not settings.redis_url:
        raise ValueError(
            "Redis is required: set REDIS_URL (or redis_url in loadmaster.yaml), "
            "e.g. redis://127.0.0.1:6379/0"
        )
    clock = clock or SystemClock()
    config = settings.gpu_broker
    ack_ms = config.replica_ack_timeout_ms
    store = RedisLeaseStore.connect(
        settings.redis_url,
        key_prefix=config.key_prefix,
        replica_ack_timeout_ms=(
            default_replica_ack_timeout_ms(settings.redis_url) if ack_ms is None else ack_ms
        ),
    )
    telemetry = (
        TelemetryReporter(
            "gpu-broker",
            default_instance_id(),
            settings.metrics.address,
            loop_lag_tick_s=settings.metrics.loop_lag_tick_ms / 1000,
        )
        if settings.metrics.enabled
        else None
    )
    hub = LeaseEventHub(store, clock=clock)
    manager = LeaseManager(
        store,
        clock=clock,
        default_ttl_s=config.lease_ttl_s,
        default_reserve_mb=config.reserve_mb,
        telemetry=telemetry,
        hub=hub,
    )
    # NVML GPUs are those of this host: registered under the node name the local model-pool uses.
    inventory = local_inventory(config, node=settings.gpu_broker.node)
    sampler = NvmlSampler.open() if config.use_nvml else None
    local_gpus = (
        LocalGpus(node=config.node, sampler=sampler, reserve_mb=config.reserve_mb) if sampler else None
    )
    reaper = Reaper(manager, clock=clock, inventory=inventory, telemetry=telemetry, local_gpus=local_gpus)

    server = GrpcServer("gpu-broker", config.listen_address, grace_s=config.shutdown_grace_s)
    server.add_service(
        SERVICE_NAME,
        gpu_broker_pb2_grpc.add_GpuBrokerServiceServicer_to_server,
        GpuBrokerServiceServicer(manager, hub),
    )

    async def start() -> None:
        if telemetry is not None:
            telemetry.start()
        await hub.start()
        await reaper.start()

    async def drain(grace_left_s: float) -> None:
        await hub.stop()  # ends every Watch stream ("watch another replica")

    async def stop() -> None:
        await reaper.stop()
        if telemetry is not None:
            await telemetry.close()
        await store.close()
        if sampler is not None:
            sampler.close()

    server.on_start(start)
    server.on_drain(drain)
    server.on_stop(stop)
    return server
