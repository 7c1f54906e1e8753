"""Wiring of the gateway: front ends -> one dispatcher -> scheduler session + worker data links."""

from __future__ import annotations

import zmq.asyncio

from loadmaster.common.config import Settings
from loadmaster.common.grpc_server import GrpcServer
from loadmaster.common.service import default_instance_id
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.gateway.dispatcher import Dispatcher
from loadmaster.gateway.frontends.edge import EdgeFrontend
from loadmaster.gateway.scheduler_link import SchedulerLink
from loadmaster.gateway.worker_link import WorkerLinks

__all__ = ["Gateway", "GatewayServer", "build"]


class Gateway:
    """The running parts, for tests and the server's hooks."""

    def __init__(self, settings: Settings) -> None:
        self.gateway_id = settings.gateway.gateway_id or default_instance_id()
        self.telemetry = TelemetryReporter(
            "gateway",
            self.gateway_id,
            settings.metrics.address if settings.metrics.enabled else None,
            flush_interval_s=settings.metrics.report_interval_ms / 1000,
        )
        self.context = zmq.asyncio.Context()
        self.dispatcher = Dispatcher(telemetry=self.telemetry)
        self.scheduler = SchedulerLink(
            settings.scheduler.address,
            self.gateway_id,
            on_grant=self.dispatcher.on_grant,
            on_reject=self.dispatcher.on_reject,
            on_lost=self.dispatcher.on_scheduler_lost,
            max_batch=settings.gateway.max_stream_batch,
        )
        self.workers = WorkerLinks(self.context, self.dispatcher.on_worker_reply)
        self.dispatcher.attach(self.scheduler, self.workers)
        self.edge = EdgeFrontend(
            settings.gateway, self.dispatcher, self.telemetry, self.context, gateway_id=self.gateway_id
        )

    async def start(self) -> None:
        self.telemetry.start()
        self.scheduler.start()
        await self.edge.start()

    async def stop(self) -> None:
        await self.edge.close()
        await self.scheduler.close()
        await self.workers.close()
        await self.telemetry.close()
        self.context.term()


class GatewayServer(GrpcServer):
    """The gateway's gRPC server (health, reflection; KServe v2 later) with its running parts."""

    def __init__(self, settings: Settings) -> None:
        super().__init__("gateway", settings.gateway.listen_address)
        self.gateway = Gateway(settings)
        self.on_start(self.gateway.start)
        self.on_stop(self.gateway.stop)


async def build(settings: Settings) -> GatewayServer:
    """The wired gateway, not yet started."""
    return GatewayServer(settings)
