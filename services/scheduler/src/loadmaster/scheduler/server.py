"""Wiring: settings -> hub + servicer + telemetry on one `GrpcServer` (not started)."""

from __future__ import annotations

from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.config import Settings
from loadmaster.common.grpc_server import GrpcServer
from loadmaster.common.liveness import LIVENESS
from loadmaster.common.ordering import load_policy_modules
from loadmaster.common.service import default_instance_id
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.scheduler.config import CoreConfig, strategy_factory
from loadmaster.scheduler.servicer import SchedulerServiceServicer
from loadmaster.scheduler.sessions import SchedulerHub
from loadmaster.v1 import scheduler_pb2, scheduler_pb2_grpc

__all__ = ["SERVICE_NAME", "build"]

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name


def build(settings: Settings, *, clock: Clock | None = None) -> GrpcServer:
    """The scheduler's gRPC server, wired; background work starts with the server."""
    metrics = settings.metrics
    telemetry = TelemetryReporter(
        "scheduler",
        default_instance_id(),
        metrics.address if metrics.enabled else None,
        loop_lag_tick_s=metrics.loop_lag_tick_ms / 1000,
    )
    load_policy_modules(settings.scheduler.policy_modules)
    make_ordering = strategy_factory(settings)
    hub = SchedulerHub(
        CoreConfig.from_settings(settings),
        clock=clock or SystemClock(),
        ordering=make_ordering(settings.scheduler.strategy, settings.scheduler.policy),
        telemetry=telemetry,
        make_ordering=make_ordering,
    )
    server = GrpcServer(
        "scheduler",
        settings.scheduler.listen_address,
        grace_s=settings.scheduler.shutdown_grace_s,
        options=LIVENESS.grpc_options(),  # it notices a silent worker or gateway in 1.3 s
    )
    server.add_service(
        SERVICE_NAME, scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server, SchedulerServiceServicer(hub)
    )

    async def start() -> None:
        telemetry.start()

    async def drain(grace_left_s: float) -> None:
        await hub.stop()  # ends every gateway and worker session: they reconnect elsewhere

    async def stop() -> None:
        await telemetry.close()

    server.on_start(start)
    server.on_drain(drain)
    server.on_stop(stop)
    return server
