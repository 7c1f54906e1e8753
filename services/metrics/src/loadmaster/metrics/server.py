"""Wiring of the metrics service: the hub behind the gRPC `Metrics` service and the HTTP app."""

from __future__ import annotations

from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.config import Settings
from loadmaster.common.grpc_server import GrpcServer
from loadmaster.metrics.dashboard_routes import dashboard_routes
from loadmaster.metrics.http import HttpServer, create_app
from loadmaster.metrics.hub import MetricsHub
from loadmaster.metrics.servicer import MetricsServiceServicer
from loadmaster.metrics.workers import SchedulerWorkers
from loadmaster.v1 import metrics_pb2, metrics_pb2_grpc

__all__ = ["SERVICE_NAME", "MetricsServer", "build"]

SERVICE_NAME = metrics_pb2.DESCRIPTOR.services_by_name["MetricsService"].full_name


class MetricsServer(GrpcServer):
    """The service's gRPC server, holding the hub and the HTTP server it runs alongside."""

    def __init__(self, listen: str, *, hub: MetricsHub, http: HttpServer, grace_s: float = 5.0) -> None:
        super().__init__("metrics", listen, grace_s=grace_s)
        self.hub = hub
        self.http = http

    @property
    def http_port(self) -> int | None:
        """The bound HTTP port once started (the real one when configured as 0)."""
        return self.http.port


async def build(settings: Settings, *, clock: Clock | None = None) -> MetricsServer:
    """A wired, not yet started metrics server; `start()` also starts the HTTP endpoint."""
    config = settings.metrics
    clock = clock or SystemClock()
    hub = MetricsHub(ring_size=config.ring_size, clock=clock, replica_ttl_s=config.replica_ttl_s)
    serving = False
    workers = SchedulerWorkers(settings.scheduler.address, clock=clock)
    app = create_app(
        hub.exposition,
        serving=lambda: serving,
        routes=dashboard_routes(hub.windows, workers=workers.rows),
        api_keys=settings.gateway.auth.api_keys,  # the gateway's keys open the dashboard too
    )
    server = MetricsServer(
        config.listen_address,
        hub=hub,
        http=HttpServer(app, host=config.http_host, port=config.http_port),
        grace_s=config.shutdown_grace_s,
    )
    server.add_service(
        SERVICE_NAME, metrics_pb2_grpc.add_MetricsServiceServicer_to_server, MetricsServiceServicer(hub)
    )

    async def start_http() -> None:
        nonlocal serving
        await server.http.start()
        serving = True

    async def drain(grace_left_s: float) -> None:
        nonlocal serving
        serving = False
        hub.close()  # ends Watch and Report streams, so the grace period is not spent on them

    async def stop() -> None:
        await server.http.stop()
        await workers.close()

    server.on_start(start_http)
    server.on_drain(drain)
    server.on_stop(stop)
    return server
