"""The Scheduler gRPC service: protobuf in, `SchedulerHub` calls, protobuf out."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.scheduler import wire
from loadmaster.scheduler.sessions import GatewayLink, SchedulerHub, WorkerLink, pump
from loadmaster.v1 import scheduler_pb2, scheduler_pb2_grpc

__all__ = ["SchedulerServiceServicer"]


class SchedulerServiceServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, hub: SchedulerHub) -> None:
        self._hub = hub

    async def Session(  # noqa: N802 - gRPC method name
        self,
        request_iterator: AsyncIterator[scheduler_pb2.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[scheduler_pb2.SessionResponse]:
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return
        if not first.hello.gateway_id:
            raise InvalidArgumentError("the first Session message must carry hello.gateway_id")
        link = self._hub.open_session(first.hello.gateway_id, accepts_credits=first.hello.accepts_credits)
        try:
            self._submit(link, first)
            async for outcomes in pump(request_iterator, lambda m: self._submit(link, m), link.outbox):
                yield wire.session_response(outcomes)
        finally:
            self._hub.close_session(link)

    def _submit(self, link: GatewayLink, message: scheduler_pb2.SessionRequest) -> None:
        batch = wire.submission(message)
        if batch:
            self._hub.submit(link, batch)

    async def WorkerSession(  # noqa: N802 - gRPC method name
        self,
        request_iterator: AsyncIterator[scheduler_pb2.WorkerSessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[scheduler_pb2.WorkerSessionResponse]:
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return
        if first.WhichOneof("kind") != "hello":
            raise InvalidArgumentError("the first WorkerSession message must be a hello")
        link = self._hub.connect_worker(wire.worker_hello(first.hello))
        try:
            async for commands in pump(request_iterator, lambda m: self._report(link, m), link.outbox):
                for command in commands:
                    yield wire.worker_command(command)
        finally:
            self._hub.disconnect_worker(link)

    def _report(self, link: WorkerLink, message: scheduler_pb2.WorkerSessionRequest) -> None:
        kind = message.WhichOneof("kind")
        if kind == "tenant_service":
            self._hub.tenant_service(link, wire.tenant_services(message.tenant_service))
            return
        if kind != "report":
            raise InvalidArgumentError("a WorkerSession sends one hello, then reports")
        self._hub.report(link, wire.slot_statuses(message.report), free_mb=message.report.free_mb)

    async def ListWorkers(  # noqa: N802 - gRPC method name
        self, request: scheduler_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ListWorkersResponse:
        return wire.list_workers_response(self._hub.core.workers())

    async def GetQueues(  # noqa: N802 - gRPC method name
        self, request: scheduler_pb2.GetQueuesRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetQueuesResponse:
        core = self._hub.core
        return wire.get_queues_response(
            core.queue_stats(),
            core.strategy,
            policy=getattr(core.ordering, "policy_name", ""),
            active_clients=core.active_clients,
        )

    async def SetStrategy(  # noqa: N802 - gRPC method name
        self, request: scheduler_pb2.SetStrategyRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SetStrategyResponse:
        if not request.strategy:
            raise InvalidArgumentError("SetStrategy needs strategy")
        try:
            previous, moved = self._hub.set_strategy(request.strategy, request.policy or None)
        except ValueError as exc:
            raise InvalidArgumentError(f"strategy: {exc}") from exc
        return scheduler_pb2.SetStrategyResponse(
            strategy=self._hub.core.strategy, previous=previous, moved=moved
        )
