"""Wiring of the gateway: front ends -> one dispatcher -> scheduler session + worker data links."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq.asyncio

from loadmaster.common import internal_auth
from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.config import Settings
from loadmaster.common.credentials import ADMIN_HEADER
from loadmaster.common.errors import LoadmasterError
from loadmaster.common.grpc_server import GrpcServer
from loadmaster.common.liveness import LIVENESS
from loadmaster.common.ordering import load_policy_modules
from loadmaster.common.service import default_instance_id
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.gateway.admin import SchedulerAdmin
from loadmaster.gateway.admin_plane import AdminPlane
from loadmaster.gateway.audit import AuditLog
from loadmaster.gateway.auth import Authenticator
from loadmaster.gateway.catalog import ModelCatalog, ModelView
from loadmaster.gateway.chat_images import ChatImages
from loadmaster.gateway.demux import Demux
from loadmaster.gateway.dispatcher import Dispatcher
from loadmaster.gateway.embeddings import Embedder
from loadmaster.gateway.exposure import warn_if_exposed
from loadmaster.gateway.frontends.admin_http import admin_routes
from loadmaster.gateway.frontends.edge import EdgeFrontend
from loadmaster.gateway.frontends.gr00t import Gr00tFrontend
from loadmaster.gateway.frontends.grpc import (
    KServeGrpcServicer,
    UndecodableRequestInterceptor,
    receive_options,
    relay_for,
)
from loadmaster.gateway.frontends.http import HttpFrontend, build_app
from loadmaster.gateway.frontends.openai_embeddings import embedding_routes
from loadmaster.gateway.frontends.openai_images import image_routes, job_error, render_images
from loadmaster.gateway.frontends.openpi import openpi_routes
from loadmaster.gateway.generations import GenerationRouter, GenerationStreams
from loadmaster.gateway.guardrails import Guardrails
from loadmaster.gateway.image_jobs import ImageJobs
from loadmaster.gateway.images import ImageGenerator
from loadmaster.gateway.jobs import RedisJobStore
from loadmaster.gateway.kserve_generative import GenerativeKServe
from loadmaster.gateway.kserve_protocol import SERVICE_NAME as KSERVE_SERVICE_NAME
from loadmaster.gateway.kserve_protocol import inference_pb2_grpc
from loadmaster.gateway.ladders import ladders_from
from loadmaster.gateway.oidc import OidcVerifier
from loadmaster.gateway.profiles import ClientPolicy
from loadmaster.gateway.readiness import Readiness
from loadmaster.gateway.request_policy import GatewayPolicy
from loadmaster.gateway.scheduler_link import SchedulerLink
from loadmaster.gateway.signatures import Signatures
from loadmaster.gateway.statistics import StatisticsSource
from loadmaster.gateway.validation import off_loop
from loadmaster.gateway.worker_link import ShmPayloads, WorkerLinks

__all__ = ["Gateway", "GatewayServer", "build"]

log = logging.getLogger(__name__)


class Gateway:
    """The running parts, for tests and the server's hooks."""

    admin_plane: AdminPlane  # read by the policies below per request, so runtime changes reach them

    def __init__(self, settings: Settings, *, clock: Clock | None = None) -> None:
        clock = clock or SystemClock()
        self._settings = settings
        self.gateway_id = settings.gateway.gateway_id or default_instance_id()
        self.telemetry = TelemetryReporter(
            "gateway",
            self.gateway_id,
            settings.metrics.address if settings.metrics.enabled else None,
            flush_interval_s=settings.metrics.report_interval_ms / 1000,
            loop_lag_tick_s=settings.metrics.loop_lag_tick_ms / 1000,
        )
        self.context = zmq.asyncio.Context()
        gateway = settings.gateway

        # What comes back on the scheduler session and the worker links goes to the component
        # that owns the request: tensor calls (the dispatcher) or generation streams.
        demux = Demux()

        def scheduler_link(dispatcher: Dispatcher) -> SchedulerLink:
            self.scheduler = SchedulerLink(
                settings.scheduler.address,
                self.gateway_id,
                on_grant=demux.on_grant,
                on_reject=demux.on_reject,
                on_lost=demux.on_scheduler_lost,
                on_credit=demux.on_credit,
                on_revoke=demux.on_revoke,
                on_placement=demux.on_placement,
                max_batch=gateway.max_stream_batch,
                connect_timeout_s=gateway.scheduler_connect_timeout_s,
                report_delay_s=gateway.report_delay_s,
                clock=clock,
            )
            return self.scheduler

        def worker_links(dispatcher: Dispatcher) -> WorkerLinks:
            self.workers = WorkerLinks(
                self.context,
                demux.on_worker_reply,
                on_lost=demux.on_worker_lost,
                on_generation_replies=demux.on_generation_replies,
                liveness=LIVENESS,
            )
            return self.workers

        self.shm = ShmPayloads(gateway.shm)
        self.dispatcher = Dispatcher(
            scheduler=scheduler_link,
            workers=worker_links,
            telemetry=self.telemetry,
            shm=self.shm,
            clock=clock,
            reply_grace_s=gateway.reply_grace_s,
            lost_grace_s=LIVENESS.lost_grace_s,
        )
        self.edge = EdgeFrontend(
            gateway, self.dispatcher, self.telemetry, self.context, gateway_id=self.gateway_id, clock=clock
        )
        self.catalog = ModelCatalog(settings.scheduler.address)
        self.signatures = Signatures(self.catalog, clock=clock)  # openpi and GR00T map dicts onto them
        self.statistics = StatisticsSource(settings.metrics.address if settings.metrics.enabled else None)
        self.readiness = Readiness(self.scheduler, self.catalog)
        oidc = settings.gateway.auth.oidc
        self.auth = Authenticator(
            settings.gateway.auth.api_keys,
            required=settings.gateway.auth.required,
            oidc=OidcVerifier(oidc, clock=clock) if oidc.enabled else None,
            oidc_settings=oidc,
            clock=clock,
            admin_token=_admin_token_check(),
        )
        audit = settings.gateway.audit
        # Always there: admin changes are audited even when request auditing is off.
        self.audit = AuditLog(
            audit, path=audit.path if audit.path.is_absolute() else settings.config_dir / audit.path
        )
        self.guardrails = Guardrails(settings.gateway.guardrails)
        # Settings the admin API may change at run time are read through the admin plane per request.
        self.policy = GatewayPolicy(
            self.guardrails,
            self.audit if audit.enabled else None,
            clock=clock,
            clients=ClientPolicy(lambda: self.admin_plane.settings.clients, clock=clock),
        )
        self.admin = SchedulerAdmin(settings.scheduler.address)
        # One port for every front end: the OpenAI routes, and KServe's text_input on language
        # models over HTTP and gRPC (one ladder router, one view of the model states).
        # Generation streams share the dispatcher's scheduler session and worker links.
        self.streams = GenerationStreams(
            scheduler=self.scheduler,
            workers=self.workers,
            telemetry=self.telemetry,
            clock=clock,
            model_view=self._model_view,
        )
        demux.calls, demux.streams = self.dispatcher, self.streams
        self.streams.ttl_ms = lambda model_id: (
            settings.models.for_model(model_id).request_ttl_ms or settings.scheduler.request_ttl_ms
        )
        self.generations = GenerationRouter(
            self.streams,
            self.catalog.models,
            ladders=ladders_from(settings.models.aliases),
            allow_cloud_fallback=lambda: self.admin_plane.settings.models.allow_cloud_fallback,
        )
        self.generative = GenerativeKServe(self.generations, self.catalog.models)
        self.admin_plane = AdminPlane(
            settings,
            auth=self.auth,
            guardrails=self.guardrails,
            generations=self.generations,
            scheduler=self.admin,
            audit=self.audit,
            gateway_id=self.gateway_id,
            store=AdminPlane.connect_store(settings),
        )
        # tenants' weights as set now (YAML, or at run time through the admin plane)
        self.streams.weights = self.admin_plane.tenant_weight
        self.chat_images = ChatImages(gateway)  # images in chat messages, every dialect's
        self.kserve_grpc = KServeGrpcServicer(
            self.dispatcher,
            self.catalog,
            self.statistics,
            self.readiness,
            self.auth,
            settings.gateway.limits,
            gateway_id=self.gateway_id,
            generative=self.generative,
            handoffs=gateway.grpc_process,
        )
        images = settings.gateway.images
        self.images = ImageGenerator(
            self.dispatcher, settings.gateway.limits, default_timeout_ms=images.timeout_ms
        )
        self.embedder = Embedder(self.dispatcher, settings.gateway.limits)
        self.image_jobs: ImageJobs | None = None
        if settings.redis_url:  # async jobs live in Redis; without one, only synchronous requests

            async def render(request: Any, pngs: list[bytes], created: int) -> str:
                return await off_loop(render_images, request, pngs, created)

            async def generate(request: Any, request_id: str, client_id: str) -> list[bytes]:
                return await self.images.generate(request, request_id=request_id, client_id=client_id)

            self.image_jobs = ImageJobs(
                RedisJobStore.connect(
                    settings.redis_url, prefix=images.job_key_prefix, ttl_s=images.job_ttl_s
                ),
                generate,
                render,
                job_error,
                images,
                owner=self.gateway_id,
                clock=clock,
            )
        app = build_app(
            settings.gateway,
            self.dispatcher,
            self.catalog,
            self.statistics,
            self.readiness,
            self.auth,
            gateway_id=self.gateway_id,
            generations=self.generations,
            generative=self.generative,
            extra_routes=[
                *image_routes(self.images, self.image_jobs, self.auth, images, gateway_id=self.gateway_id),
                *admin_routes(self.admin_plane, self.admin, self.auth),
                *openpi_routes(
                    self.dispatcher, self.signatures, self.auth, gateway.limits, gateway_id=self.gateway_id
                ),
                *embedding_routes(self.embedder, self.auth, gateway_id=self.gateway_id),
            ],
            policy=self.policy,
            images=self.chat_images,
            embedder=self.embedder,
        )
        tls = (gateway.tls_cert_file, gateway.tls_key_file)
        cert, key = (
            str(path if path.is_absolute() else settings.config_dir / path) if path is not None else None
            for path in tls
        )
        self.gr00t = (
            Gr00tFrontend(
                gateway.gr00t,
                self.dispatcher,
                self.signatures,
                self.auth,
                gateway.limits,
                self.context,
                self.telemetry,
                gateway_id=self.gateway_id,
                curve=self.edge.curve,
            )
            if gateway.gr00t.enabled
            else None
        )
        self.http = HttpFrontend(
            app,
            host=settings.gateway.http_host,
            port=settings.gateway.http_port,
            header_timeout_s=settings.gateway.limits.http_header_timeout_s,
            keep_alive_s=settings.gateway.limits.http_keep_alive_s,
            ws_max_size=gateway.limits.max_payload_bytes + gateway.limits.max_envelope_bytes,
            tls_cert_file=cert,
            tls_key_file=key,
        )

    async def _model_view(self, model_id: str) -> ModelView | None:
        """A model's catalog view (for telling a waiting stream how its model's load goes)."""
        try:
            return (await self.catalog.models()).get(model_id)
        except LoadmasterError:
            return None

    async def start(self) -> None:
        warn_if_exposed(self._settings.gateway)
        await asyncio.to_thread(self.shm.reserve)  # before any request can use it
        # Opens the file (when request auditing is on): a bad path fails the start.
        await asyncio.to_thread(self.audit.start)
        await self.admin_plane.start()  # the stored keys and settings, before anything is served
        self.telemetry.start()
        self.dispatcher.start()
        self.scheduler.start()
        await self.edge.start()
        if self.gr00t is not None:
            await self.gr00t.start()
        if self.image_jobs is not None:
            await self.image_jobs.start()
        await self.http.start()

    async def drain(self, grace_left_s: float) -> None:
        """On SIGTERM (health is already NOT_SERVING): /readyz turns 503, new requests and
        generation streams on every front end are answered `unavailable`, and those in flight
        get `grace_left_s` to finish while every link stays open."""
        self.readiness.draining = True
        if self.image_jobs is not None:
            self.image_jobs.drain()  # jobs that cannot finish now are left for the next gateway
        self.kserve_grpc.drain()  # ModelStreamInfer streams end once their requests are answered
        left, streams = await asyncio.gather(
            self.dispatcher.drain(grace_left_s), self.streams.drain(grace_left_s)
        )
        if left:
            log.warning(
                "gateway: %d request(s) still in flight when the grace ran out: %s",
                left,
                ", ".join(self.dispatcher.describe_inflight()),
            )
        if streams:
            log.warning("gateway: %d generation stream(s) still open when the grace ran out", streams)

    async def stop(self) -> None:
        await self.http.close()
        if self.gr00t is not None:
            await self.gr00t.close()
        await self.edge.close()
        if self.image_jobs is not None:
            await self.image_jobs.close()
        await self.catalog.close()
        await self.statistics.close()
        await self.admin.close()
        await self.auth.close()
        await self.guardrails.close()
        await self.chat_images.close()
        await self.admin_plane.close()
        if self.audit is not None:
            await asyncio.to_thread(self.audit.close)  # after the HTTP server: every record is in
        await self.scheduler.close()
        await self.dispatcher.close()
        await self.workers.close()
        self.shm.close()
        await self.telemetry.close()
        # Not term(): it would wait, with the loop held, for any socket a part failed to close.
        # Every part has closed its own by now; what is left has nothing worth sending.
        self.context.destroy(linger=0)


class GatewayServer(GrpcServer):
    """The gateway's gRPC server (health, reflection, KServe v2) with its running parts."""

    def __init__(self, settings: Settings, *, clock: Clock | None = None) -> None:
        # By default the public address is the relay process's, and this server its upstream.
        self.relay = relay_for(settings) if settings.gateway.grpc_process else None
        super().__init__(
            "gateway",
            self.relay.upstream if self.relay is not None else settings.gateway.listen_address,
            interceptors=[UndecodableRequestInterceptor(handoffs=self.relay is not None)],
            options=receive_options(settings.gateway.limits),
            grace_s=settings.gateway.shutdown_grace_s,
        )
        self.gateway = Gateway(settings, clock=clock)
        self.add_service(
            KSERVE_SERVICE_NAME,
            inference_pb2_grpc.add_GRPCInferenceServiceServicer_to_server,
            self.gateway.kserve_grpc,
        )
        self.on_start(self.gateway.start)
        self.on_drain(self.gateway.drain)
        self.on_stop(self.gateway.stop)
        if self.relay is not None:
            self.on_start(self.relay.start)
            self.on_stop(self.relay.stop)  # stop hooks run last-added first: before the gateway's

    async def start(self) -> int:
        port = await super().start()
        if self.relay is not None and self.relay.port is not None:
            self.port = port = self.relay.port
        return port


def _admin_token_check() -> Callable[[str], bool] | None:
    """Whether a bearer token is the suite's admin credential (`internal_auth`), when one is set."""
    credentials = internal_auth.current()
    if credentials is None:
        return None
    return lambda token: credentials.admin_verified({ADMIN_HEADER: token})


async def build(settings: Settings, *, clock: Clock | None = None) -> GatewayServer:
    """The wired gateway, not yet started."""
    try:  # the scheduler's registered policies: its credits may ask this gateway to rank by one
        load_policy_modules(settings.scheduler.policy_modules)
    except ValueError as error:
        log.error("%s; calls for models under that policy are ranked here without it", error)
    return GatewayServer(settings, clock=clock)
