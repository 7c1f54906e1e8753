"""GPU memory leases from the gpu-broker, behind a small interface.

`LeaseClient` is what the pool needs (acquire / renew / release); `GrpcLeaseClient`
is the one implementation that talks to the broker, and tests inject a double.
`LeaseKeeper` renews each held lease every ttl/3 and reports a lease the broker no
longer honours (FAILED_PRECONDITION or NOT_FOUND on renew), so the pool stops
serving that model and unloads it.
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
    NotFoundError,
    UnavailableError,
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
        request = gpu_broker_pb2.RenewRequest(
            lease_id=lease.lease_id, fencing_token=lease.fencing_token, ttl_s=ttl_s
        )
        try:
            reply = await self._broker().Renew(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as error:
            if error.code() in _TRANSIENT:
                raise self._unreachable(error) from None
            mapped = from_grpc_error(error)
            if isinstance(mapped, FailedPreconditionError | NotFoundError):
                raise LeaseLostError(f"lease {lease.lease_id}: {mapped.message}") from None
            raise mapped from None
        return _lease_from_pb(reply.lease)

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
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub = None


class LeaseKeeper:
    """Renews held leases every ttl/3; calls `on_lost(key, lease)` once a lease is gone."""

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
        self._tasks: dict[str, asyncio.Task[None]] = {}

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    def lease(self, key: str) -> Lease | None:
        return self._leases.get(key)

    def keep(self, key: str, lease: Lease) -> None:
        """Start renewing `lease` under `key` (a model id), replacing any earlier one."""
        self.forget(key)
        self._leases[key] = lease
        self._tasks[key] = asyncio.create_task(self._renew_loop(key), name=f"lease-renew-{key}")

    def forget(self, key: str) -> Lease | None:
        """Stop renewing; returns the lease (with its latest token) for release."""
        task = self._tasks.pop(key, None)
        if task is not None:
            task.cancel()
        return self._leases.pop(key, None)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    async def _renew_loop(self, key: str) -> None:
        interval = self._ttl_s / 3.0
        while True:
            await self._clock.sleep(interval)
            lease = self._leases.get(key)
            if lease is None:
                return
            started = self._clock.monotonic()
            try:
                renewed = await self._client.renew(lease, ttl_s=self._ttl_s)
            except LeaseLostError as error:
                log.error("lease for %s lost: %s", key, error.message)
                self._leases.pop(key, None)
                self._tasks.pop(key, None)
                try:
                    self._on_lost(key, lease)
                except Exception:
                    log.exception("lease-lost handler for %s failed", key)
                return
            except asyncio.CancelledError:
                raise
            except Exception as error:
                # Transient: keep the lease and try again at the next tick (TTL = 3 ticks).
                log.warning("renewing the lease for %s failed: %s", key, error)
                continue
            if self._leases.get(key) is lease and renewed.lease_id:
                self._leases[key] = renewed
            elapsed = self._clock.monotonic() - started
            if elapsed > interval / 2:
                log.warning("renewing the lease for %s took %.2fs (interval %.2fs)", key, elapsed, interval)
