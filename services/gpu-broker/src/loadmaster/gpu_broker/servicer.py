"""`GpuBrokerServiceServicer`: protobuf in, `LeaseManager` / `LeaseEventHub`, protobuf out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from loadmaster.common import internal_auth
from loadmaster.common.errors import (
    InvalidArgumentError,
    LoadmasterError,
    PermissionDeniedError,
    UnauthenticatedError,
)
from loadmaster.gpu_broker.events import LeaseEventHub
from loadmaster.gpu_broker.leases import (
    AcquireRequest,
    GpuState,
    Lease,
    LeaseEvent,
    LeaseEventKind,
    PlacementRequest,
)
from loadmaster.gpu_broker.manager import LeaseManager
from loadmaster.v1 import gpu_broker_pb2 as pb
from loadmaster.v1 import gpu_broker_pb2_grpc

__all__ = [
    "PRINCIPAL_LABEL",
    "GpuBrokerServiceServicer",
    "acquire_from_proto",
    "event_to_proto",
    "gpu_to_proto",
    "lease_to_proto",
]

# Renewals in one RenewMany call (a worker holds one lease per resident model).
MAX_RENEWALS = 1024

# The label the broker stamps on each lease: the authenticated identity that acquired it.
# Renew and Release are accepted only from that identity (or with the admin credential).
PRINCIPAL_LABEL = "loadmaster.principal"

_KINDS = {
    LeaseEventKind.ACQUIRED: pb.WatchResponse.KIND_ACQUIRED,
    LeaseEventKind.RENEWED: pb.WatchResponse.KIND_RENEWED,
    LeaseEventKind.RELEASED: pb.WatchResponse.KIND_RELEASED,
    LeaseEventKind.EXPIRED: pb.WatchResponse.KIND_EXPIRED,
}


def gpu_to_proto(gpu: GpuState) -> pb.Gpu:
    return pb.Gpu(
        node=gpu.node,
        index=gpu.index,
        uuid=gpu.uuid,
        name=gpu.name,
        total_mb=gpu.total_mb,
        reserve_mb=gpu.reserve_mb,
        used_outside_mb=gpu.used_outside_mb,
        leased_mb=gpu.leased_mb,
        free_mb=gpu.free_mb,
    )


def gpu_from_proto(node: str, gpu: pb.Gpu) -> GpuState:
    return GpuState(
        node=node,
        index=gpu.index,
        total_mb=gpu.total_mb,
        reserve_mb=gpu.reserve_mb,
        used_outside_mb=gpu.used_outside_mb,
        name=gpu.name,
        uuid=gpu.uuid,
    )


def lease_to_proto(lease: Lease) -> pb.Lease:
    return pb.Lease(
        lease_id=lease.lease_id,
        holder=lease.holder,
        node=lease.node,
        mb_per_gpu=dict(lease.mb_per_gpu),
        labels=dict(lease.labels),
        created_unix_ms=lease.created_unix_ms,
        expires_unix_ms=lease.expires_unix_ms,
        fencing_token=lease.fencing_token,
    )


def event_to_proto(event: LeaseEvent) -> pb.WatchResponse:
    return pb.WatchResponse(
        kind=_KINDS[event.kind], lease=lease_to_proto(event.lease), timestamp_unix_ms=event.timestamp_unix_ms
    )


def acquire_from_proto(request: pb.AcquireRequest) -> AcquireRequest:
    return AcquireRequest(
        client_request_id=request.client_request_id,
        holder=request.holder,
        placement=PlacementRequest(
            mb=request.mb,
            node=request.node,
            gpus=tuple(sorted(set(request.gpus))),
            allow_split=request.allow_split,
        ),
        ttl_s=request.ttl_s,
        labels=dict(request.labels),
        wait_s=request.wait_s,
        priority=request.priority,
    )


@dataclass(frozen=True, slots=True)
class _Caller:
    """Who made a call, as internal auth verified it ('' when the broker runs without it)."""

    principal: str = ""
    admin: bool = False
    peer: str = ""


def _caller(context: grpc.aio.ServicerContext) -> _Caller:
    credentials = internal_auth.current()
    if credentials is None:
        return _Caller()
    identity = internal_auth.caller(context)
    if identity is None:  # the interceptor refuses such calls: never treat one as unchecked
        raise UnauthenticatedError("no verified caller identity")
    metadata = {str(k): str(v) for k, v in context.invocation_metadata() or ()}
    return _Caller(str(identity), credentials.admin_verified(metadata), context.peer())


class GpuBrokerServiceServicer(gpu_broker_pb2_grpc.GpuBrokerServiceServicer):
    def __init__(self, manager: LeaseManager, hub: LeaseEventHub) -> None:
        self._manager = manager
        self._hub = hub

    async def RegisterNode(  # noqa: N802 - gRPC method names
        self, request: pb.RegisterNodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterNodeResponse:
        gpus = [gpu_from_proto(request.node, gpu) for gpu in request.gpus]
        registered = await self._manager.register_node(request.node, gpus)
        return pb.RegisterNodeResponse(gpus=[gpu_to_proto(g) for g in registered])

    async def Acquire(  # noqa: N802
        self, request: pb.AcquireRequest, context: grpc.aio.ServicerContext
    ) -> pb.AcquireResponse:
        return await self._acquire(request, _caller(context))

    async def Renew(self, request: pb.RenewRequest, context: grpc.aio.ServicerContext) -> pb.RenewResponse:  # noqa: N802
        return await self._renew(request, _caller(context))

    async def RenewMany(  # noqa: N802
        self, request: pb.RenewManyRequest, context: grpc.aio.ServicerContext
    ) -> pb.RenewManyResponse:
        """One call for a holder's periodic renewals: at idle, a worker's renewals cost the
        broker (and the worker) one wake-up per tick instead of one per lease."""
        if len(request.renewals) > MAX_RENEWALS:
            raise InvalidArgumentError(
                f"at most {MAX_RENEWALS} renewals per call, got {len(request.renewals)}"
            )
        refused = await self._not_holder(_caller(context), [r.lease_id for r in request.renewals], "renew")
        allowed = [r for i, r in enumerate(request.renewals) if i not in refused]
        renewed = iter(
            await self._manager.renew_many([(r.lease_id, r.fencing_token, r.ttl_s) for r in allowed])
        )
        outcomes = [refused[i] if i in refused else next(renewed) for i in range(len(request.renewals))]
        return pb.RenewManyResponse(results=[_renew_result(outcome) for outcome in outcomes])

    async def Release(  # noqa: N802
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        return await self._release(request, _caller(context))

    async def _acquire(self, request: pb.AcquireRequest, who: _Caller) -> pb.AcquireResponse:
        if who.principal:  # the broker's word on who holds it, whatever the caller labelled
            request.labels[PRINCIPAL_LABEL] = who.principal
        lease = await self._manager.acquire(acquire_from_proto(request))
        return pb.AcquireResponse(lease=lease_to_proto(lease))

    async def _renew(self, request: pb.RenewRequest, who: _Caller) -> pb.RenewResponse:
        if refused := await self._not_holder(who, [request.lease_id], "renew"):
            raise refused[0]
        lease = await self._manager.renew(
            request.lease_id, fencing_token=request.fencing_token, ttl_s=request.ttl_s
        )
        return pb.RenewResponse(lease=lease_to_proto(lease))

    async def _release(self, request: pb.ReleaseRequest, who: _Caller) -> pb.ReleaseResponse:
        if refused := await self._not_holder(who, [request.lease_id], "release"):
            raise refused[0]
        released = await self._manager.release(request.lease_id, fencing_token=request.fencing_token)
        return pb.ReleaseResponse(released=released)

    async def _not_holder(
        self, who: _Caller, lease_ids: Sequence[str], action: str
    ) -> dict[int, LoadmasterError]:
        """By index, the leases `who` may not renew or release: those another identity acquired.
        A fencing token alone proves nothing (ListLeases shows it); the caller must be the holder."""
        if not who.principal or who.admin:
            return {}
        labels = await asyncio.gather(*(self._manager.lease_labels(lease_id) for lease_id in lease_ids))
        refused: dict[int, LoadmasterError] = {}
        for index, (lease_id, found) in enumerate(zip(lease_ids, labels, strict=True)):
            owner = (found or {}).get(PRINCIPAL_LABEL, "")
            if owner and owner != who.principal:
                error = PermissionDeniedError(
                    f"lease {lease_id} is held by {owner}; only its holder may {action} it"
                )
                internal_auth.log_refusal(
                    f"{action} of lease {lease_id}", who.peer, who.principal, error.message
                )
                refused[index] = error
        return refused

    async def ListLeases(  # noqa: N802
        self, request: pb.ListLeasesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListLeasesResponse:
        leases = await self._manager.leases(node=request.node, holder=request.holder)
        return pb.ListLeasesResponse(leases=[lease_to_proto(lease) for lease in leases])

    async def Inventory(  # noqa: N802
        self, request: pb.InventoryRequest, context: grpc.aio.ServicerContext
    ) -> pb.InventoryResponse:
        gpus = await self._manager.inventory(request.node)
        return pb.InventoryResponse(gpus=[gpu_to_proto(g) for g in gpus])

    async def Watch(  # noqa: N802
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchResponse]:
        watcher = self._hub.watch()
        try:
            # Headers go out once the watcher is registered: a client that awaits
            # `call.initial_metadata()` knows every later event will reach it.
            await context.send_initial_metadata(())
            async for event in watcher:
                yield event_to_proto(event)
        finally:
            watcher.close()


def _renew_result(outcome: Lease | LoadmasterError) -> pb.RenewResult:
    if isinstance(outcome, LoadmasterError):
        return pb.RenewResult(error=pb.LeaseOpError(code=outcome.code, message=outcome.message))
    return pb.RenewResult(lease=lease_to_proto(outcome))
