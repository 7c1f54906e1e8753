"""The one asyncio client of the gpu-broker's leases: Acquire, Renew, Release.

    client = AsyncLeaseClient("127.0.0.1:50053", holder="worker-1", node="local")
    lease = await client.acquire(mb=4096, ttl_s=15.0, labels={"model": "policy"})
    lease = await client.renew(lease, ttl_s=15.0)      # LeaseLostError: not ours any more
    await client.release(lease)
    await client.close()

Used by the model pool, by `GpuLease` / `AsyncGpuLease` (the SDK's context managers) and,
through them, by `loadmaster gpu lease`. What to do with a lease over time (renewing it on a
thread of its own, stopping use of it at the holder's deadline) is `lease_keeper.LeaseKeeper`.

The grace is asked for here: a lease of TTL `ttl_s` is requested from the broker for
`LeaseTiming.for_ttl(ttl_s).regrant_after_s` (TTL + grace), so the broker keeps the memory
promised that long after it got the Acquire/Renew, while the holder (`LeaseKeeper`) stops using
it `margin_s` before the TTL ends, counted from the send.

Every `Lease` carries `sent_monotonic`: when the call that granted or renewed it was SENT, on
this process's monotonic clock. The holder's deadline counts from there (see `LeaseTiming`).

Acquire is idempotent: an UNAVAILABLE attempt is retried (backing off) with the same client
request id. An Acquire interrupted in flight (cancelled, its deadline, Ctrl-C) may have been
granted without the reply arriving: before the interruption propagates, the same request is
sent again, not waiting, and the lease it answers with (if any) is released at once.

Renewals made in the same event-loop turn leave as one `RenewMany` call (a worker holding N
leases wakes itself and the broker once per tick instead of N times); an older broker without
RenewMany gets one Renew per lease.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from loadmaster.common.config import LeaseTiming
from loadmaster.common.errors import (
    CancelledError_,
    ExpiredError,
    FailedPreconditionError,
    InternalError,
    LoadmasterError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
    error_for_code,
    from_grpc_error,
)
from loadmaster.common.grpc_client import aio_channel
from loadmaster.common.liveness import LIVENESS
from loadmaster.common.retry import retry_options
from loadmaster.v1 import gpu_broker_pb2 as pb
from loadmaster.v1 import gpu_broker_pb2_grpc

__all__ = [
    "DEFAULT_BROKER",
    "MAX_RENEWALS_PER_CALL",
    "AsyncLeaseClient",
    "Lease",
    "LeaseClient",
    "LeaseLostError",
    "default_holder",
]

log = logging.getLogger(__name__)

DEFAULT_BROKER = "127.0.0.1:50053"
# The broker's cap on renewals per RenewMany call.
MAX_RENEWALS_PER_CALL = 1024
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_CLEANUP_TIMEOUT_S = 5.0  # the replay + release after an interrupted Acquire


class LeaseLostError(FailedPreconditionError):
    """The broker no longer holds this lease for us (released, expired, fenced, or its Redis
    lost it), or the holder's own deadline passed: stop using its memory."""


@dataclass(frozen=True, slots=True)
class Lease:
    """A granted lease, as its holder knows it."""

    lease_id: str
    fencing_token: int
    mb_per_gpu: Mapping[int, int] = field(default_factory=dict)
    expires_unix_ms: int = 0  # when the broker may re-grant the memory (TTL + grace)
    node: str = ""
    holder: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    sent_monotonic: float = 0.0  # when the granting Acquire/Renew was sent (time.monotonic())

    @property
    def gpus(self) -> list[int]:
        return sorted(self.mb_per_gpu)

    @property
    def mb(self) -> int:
        return sum(self.mb_per_gpu.values())

    @classmethod
    def from_pb(cls, lease: pb.Lease, *, sent_monotonic: float) -> Lease:
        return cls(
            lease_id=lease.lease_id,
            fencing_token=lease.fencing_token,
            mb_per_gpu=dict(lease.mb_per_gpu),
            expires_unix_ms=lease.expires_unix_ms,
            node=lease.node,
            holder=lease.holder,
            labels=dict(lease.labels),
            sent_monotonic=sent_monotonic,
        )


class LeaseClient(Protocol):
    """What a holder needs of the broker (`AsyncLeaseClient`; tests inject a double)."""

    async def acquire(
        self,
        *,
        mb: int,
        ttl_s: float,
        labels: Mapping[str, str],
        gpus: Sequence[int] | None = None,
        allow_split: bool = False,
        node: str | None = None,
    ) -> Lease:
        """Take `mb` on one GPU (or spread over several with `allow_split`);
        `ResourceExhaustedError` when it does not fit, `UnavailableError` when unreachable."""

    async def renew(self, lease: Lease, *, ttl_s: float) -> Lease:
        """Extend; `LeaseLostError` when the lease is gone, `UnavailableError` when unreachable."""

    async def release(self, lease: Lease) -> None:
        """Give back; idempotent, never raises for a lease that is already gone."""

    async def free_mb(self) -> dict[int, int]:
        """The broker's free MB per GPU of this client's node."""

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until the broker can be reached; False if it could not."""

    async def close(self) -> None: ...


def _broker_ttl_s(ttl_s: float) -> float:
    """What the broker is asked to keep a lease of TTL `ttl_s` for: TTL + grace."""
    return LeaseTiming.for_ttl(ttl_s).regrant_after_s


def default_holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _lost_or(lease: Lease, error: LoadmasterError) -> LoadmasterError:
    """`LeaseLostError` for the answers that mean the lease is not ours any more."""
    if isinstance(error, FailedPreconditionError | NotFoundError):
        return LeaseLostError(f"lease {lease.lease_id}: {error.message}")
    return error


def _maybe_granted(error: BaseException) -> bool:
    """Whether an Acquire that ended with `error` may have been granted without us seeing it:
    interrupted (not a broker answer at all), cancelled, or past its deadline."""
    return not isinstance(error, LoadmasterError) or isinstance(error, CancelledError_ | ExpiredError)


@dataclass(slots=True)
class _Renewal:
    lease: Lease
    ttl_s: float
    reply: asyncio.Future[Lease]


class AsyncLeaseClient:
    """Acquire/Renew/Release over one grpc.aio channel, bound to the event loop that first uses it."""

    def __init__(
        self,
        address: str = DEFAULT_BROKER,
        *,
        holder: str = "",
        node: str = "",
        timeout_s: float = 3.0,
        attempts: int = 3,  # Acquire (and the other idempotent calls) in all, at most 5
    ) -> None:
        self._address = address
        self._holder = holder or default_holder()
        self._node = node
        self._timeout_s = timeout_s
        self._attempts = min(5, max(1, attempts))
        self._channel: grpc.aio.Channel | None = None
        self._stub: gpu_broker_pb2_grpc.GpuBrokerServiceStub | None = None
        self._renewals: list[_Renewal] = []  # waiting for the next RenewMany
        self._senders: set[asyncio.Task[None]] = set()  # strong references to running sends
        self._renew_many = True  # False once a broker answered UNIMPLEMENTED (an older broker)

    @property
    def address(self) -> str:
        return self._address

    def _broker(self) -> gpu_broker_pb2_grpc.GpuBrokerServiceStub:
        if self._stub is None:
            # aio_channel caps reconnect backoff well below a lease TTL, so renewals get
            # through soon after the broker is back; gRPC retries the idempotent calls
            # (Acquire, Renew, RenewMany, reads) while the broker is UNAVAILABLE. A silent
            # broker is left within 1.8 s, for a new connection (docs/liveness.md).
            retries = retry_options(max_attempts=self._attempts) if self._attempts > 1 else []
            self._channel = aio_channel(self._address, options=[*LIVENESS.grpc_options(), *retries])
            self._stub = gpu_broker_pb2_grpc.GpuBrokerServiceStub(self._channel)
        return self._stub

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until the broker can be reached; False if it could not. A
        holder started beside its broker waits here rather than fail its first Acquire."""
        self._broker()
        assert self._channel is not None
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except TimeoutError:
            return False
        return True

    def _unreachable(self, error: grpc.aio.AioRpcError) -> UnavailableError:
        return UnavailableError(
            f"gpu-broker at {self._address} unreachable: {error.code().name} {error.details() or ''}".strip()
        )

    # ---- acquire ----------------------------------------------------------------

    async def acquire(
        self,
        *,
        mb: int,
        ttl_s: float,
        labels: Mapping[str, str] | None = None,
        gpus: Sequence[int] | None = None,
        allow_split: bool = False,
        node: str | None = None,
        wait_s: float = 0.0,
        priority: int = 0,
    ) -> Lease:
        """The lease, or the broker's refusal as a `LoadmasterError` (`ResourceExhaustedError`
        when it does not fit, `UnavailableError` when the broker cannot be reached)."""
        if mb <= 0:
            raise ValueError(f"mb must be > 0, got {mb}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        request = pb.AcquireRequest(
            client_request_id=uuid.uuid4().hex,
            holder=self._holder,
            node=self._node if node is None else node,
            mb=mb,
            gpus=list(gpus or ()),
            allow_split=allow_split,
            ttl_s=_broker_ttl_s(ttl_s),
            # `pid` lets the broker's NVML reconciliation tell this process's GPU memory
            # (covered by the lease) from memory used outside any lease.
            labels={"pid": str(os.getpid()), "host": socket.gethostname(), **(labels or {})},
            wait_s=wait_s,
            priority=priority,
        )
        try:
            lease = await self._acquire_with_retries(request)
        except BaseException as error:  # asyncio.CancelledError, KeyboardInterrupt included
            if _maybe_granted(error):
                await asyncio.shield(self._release_unseen_grant(request))
            raise
        if time.monotonic() - lease.sent_monotonic > LeaseTiming.for_ttl(ttl_s).renew_every_s:
            # It waited for memory (or retried): the holder's deadline counts from the send, which
            # may be long past. One renewal now gives it a fresh base instead of a lapsed lease.
            lease = await self.renew(lease, ttl_s=ttl_s)
        return lease

    async def _acquire_with_retries(self, request: pb.AcquireRequest) -> Lease:
        """One Acquire; gRPC sends it again (same `client_request_id`, so a grant is never made
        twice) while the broker is UNAVAILABLE, `attempts` in all (the channel's retry policy)."""
        sent = time.monotonic()  # the keeper counts the deadline from the first send: never late
        try:
            reply = await self._broker().Acquire(request, timeout=request.wait_s + self._timeout_s)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # may be granted: cleaned up
                raise ExpiredError(f"gpu-broker Acquire at {self._address} timed out") from None
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                raise self._unreachable(error) from None
            raise from_grpc_error(error) from None
        return Lease.from_pb(reply.lease, sent_monotonic=sent)

    async def _release_unseen_grant(self, request: pb.AcquireRequest) -> None:
        replay = pb.AcquireRequest()
        replay.CopyFrom(request)
        replay.wait_s = 0  # the lease it got if it was granted, else (at most) a new one
        try:
            granted = (await self._broker().Acquire(replay, timeout=_CLEANUP_TIMEOUT_S)).lease
            await self._broker().Release(
                pb.ReleaseRequest(lease_id=granted.lease_id, fencing_token=granted.fencing_token),
                timeout=_CLEANUP_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as raw:
            error = from_grpc_error(raw)
            if not isinstance(error, ResourceExhaustedError | FailedPreconditionError):  # nothing held
                log.warning(
                    "could not release what interrupted acquire %s may have been granted "
                    "(it expires by itself): %s",
                    request.client_request_id,
                    error,
                )

    # ---- renew ------------------------------------------------------------------

    async def renew(self, lease: Lease, *, ttl_s: float) -> Lease:
        """Renewals made in the same event-loop turn leave as one RenewMany call; each caller
        gets its own lease (with `sent_monotonic` of this call) or error, as from a unary Renew."""
        renewal = _Renewal(lease, ttl_s, asyncio.get_running_loop().create_future())
        self._renewals.append(renewal)
        if len(self._renewals) == 1:  # the first of a batch: send it once the others joined
            sender = asyncio.create_task(self._send_renewals(), name="lease-renew-many")
            self._senders.add(sender)
            sender.add_done_callback(self._senders.discard)
        return await renewal.reply

    async def _send_renewals(self) -> None:
        """Runs as its own task, so a cancelled caller never cancels the others' renewals."""
        batch, self._renewals = [r for r in self._renewals if not r.reply.done()], []
        for start in range(0, len(batch), MAX_RENEWALS_PER_CALL):
            chunk = batch[start : start + MAX_RENEWALS_PER_CALL]
            try:
                if self._renew_many:
                    await self._renew_chunk(chunk)
                else:
                    await asyncio.gather(*(self._renew_one(r) for r in chunk))
            except Exception as error:  # every caller hears of it; nothing is left hanging
                for renewal in chunk:
                    if not renewal.reply.done():
                        renewal.reply.set_exception(error)

    async def _renew_chunk(self, chunk: list[_Renewal]) -> None:
        request = pb.RenewManyRequest(
            renewals=[
                pb.RenewRequest(
                    lease_id=r.lease.lease_id,
                    fencing_token=r.lease.fencing_token,
                    ttl_s=_broker_ttl_s(r.ttl_s),
                )
                for r in chunk
            ]
        )
        sent = time.monotonic()  # the keeper counts the deadline on this clock
        try:
            reply = await self._broker().RenewMany(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("gpu-broker at %s has no RenewMany; renewing one lease per call", self._address)
                self._renew_many = False
                await asyncio.gather(*(self._renew_one(r) for r in chunk))
                return
            if error.code() in _TRANSIENT:
                raise self._unreachable(error) from None
            raise from_grpc_error(error) from None
        if len(reply.results) != len(chunk):
            raise InternalError(f"gpu-broker answered {len(reply.results)} of {len(chunk)} renewals")
        for renewal, result in zip(chunk, reply.results, strict=True):
            if renewal.reply.done():
                continue
            if result.WhichOneof("result") == "lease":
                renewal.reply.set_result(Lease.from_pb(result.lease, sent_monotonic=sent))
            else:
                failure = error_for_code(result.error.code, result.error.message)
                renewal.reply.set_exception(_lost_or(renewal.lease, failure))

    async def _renew_one(self, renewal: _Renewal) -> None:
        request = pb.RenewRequest(
            lease_id=renewal.lease.lease_id,
            fencing_token=renewal.lease.fencing_token,
            ttl_s=_broker_ttl_s(renewal.ttl_s),
        )
        sent = time.monotonic()  # the keeper counts the deadline on this clock
        try:
            reply = await self._broker().Renew(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as error:
            failure = (
                self._unreachable(error)
                if error.code() in _TRANSIENT
                else _lost_or(renewal.lease, from_grpc_error(error))
            )
            if not renewal.reply.done():
                renewal.reply.set_exception(failure)
            return
        if not renewal.reply.done():
            renewal.reply.set_result(Lease.from_pb(reply.lease, sent_monotonic=sent))

    # ---- release ----------------------------------------------------------------

    async def release(self, lease: Lease) -> None:
        request = pb.ReleaseRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token)
        try:
            await self._broker().Release(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as error:
            if error.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                return  # already gone or fenced: nothing of ours to give back
            if error.code() in _TRANSIENT:
                raise self._unreachable(error) from None
            raise from_grpc_error(error) from None

    async def free_mb(self) -> dict[int, int]:
        try:
            reply = await self._broker().Inventory(
                pb.InventoryRequest(node=self._node), timeout=self._timeout_s
            )
        except grpc.aio.AioRpcError as error:
            if error.code() in _TRANSIENT:
                raise self._unreachable(error) from None
            raise from_grpc_error(error) from None
        return {gpu.index: gpu.free_mb for gpu in reply.gpus if not self._node or gpu.node == self._node}

    async def close(self) -> None:
        for sender in list(self._senders):
            sender.cancel()
        await asyncio.gather(*self._senders, return_exceptions=True)
        for renewal in self._renewals:
            renewal.reply.cancel()
        self._renewals.clear()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub = None
