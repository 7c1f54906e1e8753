"""The worker's side of the scheduler's `WorkerSession` stream.

On connect: a hello (worker id, data and gRPC endpoints, node, the models in the
repository), then a full `WorkerReport`; after that a full report whenever a slot
changes state (changes that arrive together are coalesced into one report). Load
and Unload commands are obeyed as background tasks, so a slow load never stalls
the stream. Every `TENANT_SERVICE_EVERY_S`, when it changed, the weighted service the
worker's generative models gave each tenant goes up too; the scheduler answers with what
each tenant got on the other workers (`remote_service`), for fairness across workers
(docs/generation-scheduling.md). When the stream drops (or the scheduler is not up yet) the session
reconnects with exponential backoff and starts again with hello + report.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.errors import LoadmasterError, ResourceExhaustedError
from loadmaster.common.grpc_client import FRESH_CONNECT_OPTIONS, aio_channel
from loadmaster.common.liveness import LIVENESS
from loadmaster.common.retry import Backoff
from loadmaster.model_pool.pool import ModelPool
from loadmaster.model_pool.slots import SlotStatus
from loadmaster.model_pool.wire import slot_status_pb
from loadmaster.v1 import scheduler_pb2, scheduler_pb2_grpc

__all__ = ["WorkerIdentity", "WorkerSession"]

log = logging.getLogger(__name__)

TENANT_SERVICE_EVERY_S = 0.5


class TenantServices(Protocol):
    """The generation port's side of fairness across workers."""

    def tenant_service(self) -> dict[str, dict[str, float]]: ...

    def set_remote_service(self, models: dict[str, dict[str, float]]) -> None: ...


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    worker_id: str
    data_endpoint: str
    grpc_endpoint: str
    node: str


class WorkerSession:
    def __init__(
        self,
        address: str,
        pool: ModelPool,
        *,
        identity: WorkerIdentity,
        clock: Clock | None = None,
        min_backoff_s: float = 0.1,
        max_backoff_s: float = 1.0,  # a standby scheduler that took over is found within a second
        stable_after_s: float = 5.0,
        generations: TenantServices | None = None,
    ) -> None:
        self._address = address
        self._pool = pool
        self._identity = identity
        self._clock = clock or SystemClock()
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self._stable_after_s = stable_after_s
        self._generations = generations
        self._service_sent: dict[str, dict[str, float]] = {}
        self._dirty = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._commands: set[asyncio.Task[Any]] = set()
        self.sessions = 0  # streams opened so far (for logs and tests)

    def start(self) -> None:
        if self._task is not None:
            return
        self._pool.add_listener(self._on_change)
        self._task = asyncio.create_task(self._run(), name="worker-session")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._commands) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None

    def _on_change(self, status: SlotStatus) -> None:
        self._dirty.set()

    # ---- stream ------------------------------------------------------------

    def _hello(self) -> scheduler_pb2.WorkerSessionRequest:
        return scheduler_pb2.WorkerSessionRequest(
            hello=scheduler_pb2.WorkerHello(
                worker_id=self._identity.worker_id,
                data_endpoint=self._identity.data_endpoint,
                grpc_endpoint=self._identity.grpc_endpoint,
                node=self._identity.node,
                repository=self._pool.repository.names(),
            )
        )

    def _report(self) -> scheduler_pb2.WorkerSessionRequest:
        report = scheduler_pb2.WorkerReport(
            models=[slot_status_pb(s) for s in self._pool.statuses()], free_mb=self._pool.free_mb()
        )
        return scheduler_pb2.WorkerSessionRequest(report=report)

    def _tenant_service(self) -> scheduler_pb2.WorkerSessionRequest | None:
        """The tenants' service, when it changed since the last one sent."""
        if self._generations is None:
            return None
        service = self._generations.tenant_service()
        if service == self._service_sent:
            return None
        self._service_sent = service
        models = [scheduler_pb2.TenantService(model_id=m, service=s) for m, s in sorted(service.items())]
        return scheduler_pb2.WorkerSessionRequest(tenant_service=scheduler_pb2.TenantServices(models=models))

    async def _messages(self, dirty: asyncio.Event) -> AsyncIterator[scheduler_pb2.WorkerSessionRequest]:
        """One session's stream. It ends once a later session has its own `dirty`: grpc.aio goes
        on reading a request iterator after its call failed, and a stale stream that took a
        change (or a tenant-service diff) would leave the scheduler without it (after three
        freezes, a model loaded on the worker never showed READY there)."""
        self._service_sent = {}  # a new session (maybe a new scheduler) hears it all again
        yield self._hello()
        yield self._report()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(dirty.wait(), TENANT_SERVICE_EVERY_S)
            if dirty is not self._dirty:
                return
            if dirty.is_set():
                dirty.clear()
                yield self._report()
            if (service := self._tenant_service()) is not None:
                yield service

    async def _run(self) -> None:
        backoff = Backoff(first_s=self._min_backoff_s, max_s=self._max_backoff_s)
        while True:
            opened = self._clock.monotonic()
            try:
                options = [*FRESH_CONNECT_OPTIONS, *LIVENESS.grpc_options()]  # a silent scheduler: 1.8 s
                async with aio_channel(self._address, options=options) as channel:
                    self._dirty = dirty = asyncio.Event()  # this session's: the last one's stream ends
                    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
                    call = stub.WorkerSession(self._messages(dirty))
                    self.sessions += 1
                    async for command in call:
                        self._obey(command)
                log.warning("scheduler at %s ended the worker session", self._address)
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as error:
                log.warning(
                    "worker session to %s dropped: %s %s", self._address, error.code().name, error.details()
                )
            except Exception:
                log.exception("worker session failed")
            if self._clock.monotonic() - opened >= self._stable_after_s:
                backoff.reset()
            await self._clock.sleep(backoff.next_s())

    # ---- commands ----------------------------------------------------------

    def _obey(self, command: scheduler_pb2.WorkerSessionResponse) -> None:
        kind = command.WhichOneof("kind")
        if kind == "load":
            self._background(self._pool.load(command.load), f"load {command.load}")
        elif kind == "unload":
            self._background(
                self._pool.unload(command.unload, reason="scheduler command"),
                f"unload {command.unload}",
            )
        elif kind == "remote_service":
            if self._generations is not None:
                models = {m.model_id: dict(m.service) for m in command.remote_service.models}
                self._generations.set_remote_service(models)
        else:
            log.warning("ignoring an unknown worker command: %s", kind)

    def _background(self, work: Coroutine[Any, Any, Any], what: str) -> None:
        async def run() -> None:
            try:
                await work
            except ResourceExhaustedError as error:  # no room yet: the scheduler retries
                log.info("%s (scheduler command) found no room: %s", what, error.message)
            except LoadmasterError as error:
                log.warning("%s (scheduler command) failed: %s", what, error.message)
            except Exception:
                log.exception("%s (scheduler command) failed", what)

        task = asyncio.create_task(run(), name=what)
        self._commands.add(task)
        task.add_done_callback(self._commands.discard)
