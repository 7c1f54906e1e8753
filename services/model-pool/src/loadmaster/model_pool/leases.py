"""GPU memory leases from the gpu-broker, behind a small interface.

`LeaseClient` is what the pool needs (acquire / renew / release); `GrpcLeaseClient`
is the one implementation that talks to the broker, and tests inject a double.
`LeaseKeeper` renews every held lease every ttl/3 and reports a lease the broker no
longer honours (FAILED_PRECONDITION or NOT_FOUND on renew), so the pool stops
serving that model and unloads it.

Idle cost: the keeper renews all its leases on one timer, and `GrpcLeaseClient` sends
renewals made together as one `RenewMany` call, so a worker holding N leases wakes
itself and the broker once per tick instead of N times (measured: ~1.4 ms of broker CPU
per unary Renew, most of it per call, not per lease).
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.errors import (
    FailedPreconditionError,
    InternalError,
    LoadmasterError,
    NotFoundError,
    UnavailableError,
    error_for_code,
    from_grpc_error,
)
from loadmaster.common.grpc_client import aio_channel
from loadmaster.v1 import gpu_broker_pb2, gpu_broker_pb2_grpc

__all__ = [
    "GrpcLeaseClient",
    "Lease",
    "LeaseClient",
    "LeaseKeeper",
    "LeaseLostError",
    "device_for_lease",
    "gpus_for_device",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    fencing_token: int
    mb_per_gpu: Mapping[int, int] = field(default_factory=dict)
    expires_unix_ms: int = 0

    @property
    def gpus(self) -> list[int]:
        return sorted(self.mb_per_gpu)


def gpus_for_device(device: str) -> list[int]:
    """The GPUs to ask the broker for: `cuda:N` -> [N]; `cuda` / `cpu` -> any."""
    kind, _, index = device.partition(":")
    return [int(index)] if kind == "cuda" and index else []


def device_for_lease(device: str, lease: Lease) -> str:
    """`cuda` (any GPU) becomes the GPU the broker granted; explicit devices stay as they are."""
    if device == "cuda":
        return f"cuda:{lease.gpus[0]}" if lease.gpus else "cuda:0"
    return device


class LeaseLostError(FailedPreconditionError):
    """The broker no longer honours a lease (expired or fenced): the memory is not ours."""


class LeaseClient(Protocol):
    async def acquire(
        self,
        *,
        mb: int,
        ttl_s: float,
        labels: Mapping[str, str],
        gpus: list[int] | None = None,
        allow_split: bool = False,
    ) -> Lease:
        """Take `mb` on one GPU (or spread over several with `allow_split`);
        `ResourceExhaustedError` when it does not fit, `UnavailableError` when unreachable."""

    async def renew(self, lease: Lease, *, ttl_s: float) -> Lease:
        """Extend; `LeaseLostError` when the lease is gone, `UnavailableError` when unreachable."""

    async def release(self, lease: Lease) -> None:
        """Give back; idempotent, never raises for a lease that is already gone."""

    async def close(self) -> None: ...


def _lease_from_pb(lease: gpu_broker_pb2.Lease) -> Lease:
    return Lease(
        lease_id=lease.lease_id,
        fencing_token=lease.fencing_token,
        mb_per_gpu=dict(lease.mb_per_gpu),
        expires_unix_ms=lease.expires_unix_ms,
    )


_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# The broker's cap on renewals per RenewMany call.
MAX_RENEWALS_PER_CALL = 1024


@dataclass(slots=True)
class _Renewal:
    lease: Lease
    ttl_s: float
    reply: asyncio.Future[Lease]


def _lost_or(lease: Lease, error: LoadmasterError) -> LoadmasterError:
    """`LeaseLostError` for the answers that mean the lease is not ours any more."""
    if isinstance(error, FailedPreconditionError | NotFoundError):
        return LeaseLostError(f"lease {lease.lease_id}: {error.message}")
    return error


class GrpcLeaseClient:
    """Acquire/Renew/Release over gRPC; a retried Acquire reuses its client request id."""

    def __init__(
        self,
        address: str,
        *,
        holder: str,
        node: str,
        timeout_s: float = 3.0,
        attempts: int = 3,
        clock: Clock | None = None,
    ) -> None:
        self._address = address
        self._holder = holder
        self._node = node
        self._timeout_s = timeout_s
        self._attempts = max(1, attempts)
        self._clock = clock or SystemClock()
        self._channel: grpc.aio.Channel | None = None
        self._stub: gpu_broker_pb2_grpc.GpuBrokerStub | None = None
        self._renewals: list[_Renewal] = []  # waiting for the next RenewMany
        self._senders: set[asyncio.Task[None]] = set()  # strong references to running sends
        self._renew_many = True  # False once a broker answered UNIMPLEMENTED (an older broker)

    def _broker(self) -> gpu_broker_pb2_grpc.GpuBrokerStub:
        if self._stub is None:
            # aio_channel caps reconnect backoff well below a lease TTL, so renewals get
            # through soon after the broker is back.
            self._channel = aio_channel(self._address)
            self._stub = gpu_broker_pb2_grpc.GpuBrokerStub(self._channel)
        return self._stub

    def _unreachable(self, error: grpc.aio.AioRpcError) -> UnavailableError:
        return UnavailableError(
            f"gpu-broker at {self._address} unreachable: {error.code().name} {error.details() or ''}".strip()
        )

    async def acquire(
        self,
        *,
        mb: int,
        ttl_s: float,
        labels: Mapping[str, str],
        gpus: list[int] | None = None,
        allow_split: bool = False,
    ) -> Lease:
        request = gpu_broker_pb2.AcquireRequest(
            client_request_id=uuid.uuid4().hex,
            holder=self._holder,
            node=self._node,
            mb=mb,
            gpus=gpus or [],
            allow_split=allow_split,
            ttl_s=ttl_s,
            # `pid` lets the broker's NVML reconciliation tell this worker's GPU memory (covered
            # by the lease) from memory used outside any lease.
            labels={"pid": str(os.getpid()), **labels},
        )
        delay = 0.1
        for attempt in range(1, self._attempts + 1):
            try:
                reply = await self._broker().Acquire(request, timeout=self._timeout_s)
                return _lease_from_pb(reply.lease)
            except grpc.aio.AioRpcError as error:
                if error.code() not in _TRANSIENT:
                    raise from_grpc_error(error) from None
                if attempt == self._attempts:
                    raise self._unreachable(error) from None
                log.warning("gpu-broker Acquire attempt %d failed (%s); retrying", attempt, error.code().name)
            await self._clock.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    async def renew(self, lease: Lease, *, ttl_s: float) -> Lease:
        """Renewals made in the same event-loop turn (the keeper's tick) leave as one
        RenewMany call; each caller gets its own lease or error, as from a unary Renew."""
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
        request = gpu_broker_pb2.RenewManyRequest(
            renewals=[
                gpu_broker_pb2.RenewRequest(
                    lease_id=r.lease.lease_id, fencing_token=r.lease.fencing_token, ttl_s=r.ttl_s
                )
                for r in chunk
            ]
        )
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
                renewal.reply.set_result(_lease_from_pb(result.lease))
            else:
                failure = error_for_code(result.error.code, result.error.message)
                renewal.reply.set_exception(_lost_or(renewal.lease, failure))

    async def _renew_one(self, renewal: _Renewal) -> None:
        request = gpu_broker_pb2.RenewRequest(
            lease_id=renewal.lease.lease_id, fencing_token=renewal.lease.fencing_token, ttl_s=renewal.ttl_s
        )
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
            renewal.reply.set_result(_lease_from_pb(reply.lease))

    async def release(self, lease: Lease) -> None:
        request = gpu_broker_pb2.ReleaseRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token)
        try:
            await self._broker().Release(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as error:
            if error.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                return  # already gone or fenced: nothing of ours to give back
            if error.code() in _TRANSIENT:
                raise self._unreachable(error) from None
            raise from_grpc_error(error) from None

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


class LeaseKeeper:
    """Renews every held lease every ttl/3, all on one timer; calls `on_lost(key, lease)`
    once a lease is gone (for exactly the leases that are: the others stay kept).

    A lease kept between two ticks is first renewed at the next one, so each lease is
    renewed at most ttl/3 after it was granted or last renewed, as with a timer of its own.
    With nothing to keep, the timer stops (an idle worker with no models never wakes for it).
    """

    def __init__(
        self,
        client: LeaseClient,
        *,
        ttl_s: float,
        on_lost: Callable[[str, Lease], None],
        clock: Clock | None = None,
    ) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._on_lost = on_lost
        self._clock = clock or SystemClock()
        self._leases: dict[str, Lease] = {}
        self._task: asyncio.Task[None] | None = None

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    def lease(self, key: str) -> Lease | None:
        return self._leases.get(key)

    def keep(self, key: str, lease: Lease) -> None:
        """Start renewing `lease` under `key` (a model id), replacing any earlier one."""
        self._leases[key] = lease
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._renew_loop(), name="lease-renew")

    def forget(self, key: str) -> Lease | None:
        """Stop renewing; returns the lease (with its latest token) for release. A renewal
        of it already in flight is ignored when it comes back."""
        return self._leases.pop(key, None)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _renew_loop(self) -> None:
        interval = self._ttl_s / 3.0
        tick = self._clock.monotonic() + interval
        while self._leases:
            # Ticks keep their rate (a slow renewal does not push the next one back), unless
            # the loop fell a whole interval behind.
            await self._clock.sleep(tick - self._clock.monotonic())
            started = self._clock.monotonic()
            tick = max(tick + interval, started)
            held = list(self._leases.items())
            outcomes = await asyncio.gather(
                *(self._client.renew(lease, ttl_s=self._ttl_s) for _, lease in held), return_exceptions=True
            )
            for (key, lease), outcome in zip(held, outcomes, strict=True):
                self._settle(key, lease, outcome)
            elapsed = self._clock.monotonic() - started
            if elapsed > interval / 2:
                log.warning("renewing %d lease(s) took %.2fs (interval %.2fs)", len(held), elapsed, interval)
        self._task = None

    def _settle(self, key: str, lease: Lease, outcome: Lease | BaseException) -> None:
        if self._leases.get(key) is not lease:
            return  # forgotten or replaced while the renewal travelled
        if isinstance(outcome, LeaseLostError):
            log.error("lease for %s lost: %s", key, outcome.message)
            del self._leases[key]
            try:
                self._on_lost(key, lease)
            except Exception:
                log.exception("lease-lost handler for %s failed", key)
        elif isinstance(outcome, BaseException):
            # Transient: keep the lease and try again at the next tick (TTL = 3 ticks).
            log.warning("renewing the lease for %s failed: %s", key, outcome)
        elif outcome.lease_id:
            self._leases[key] = outcome
