"""GPU memory leases for training jobs and tools: `with GpuLease(mb=4096) as lease: ...`.

The lease is acquired from the gpu-broker on entry, renewed in the background while the
block runs (every third of its TTL), and released on exit, also when the block raises.
If a renewal learns the lease was lost (it expired, or its fencing token went stale), the
lease is marked `lost` and `on_lost` is called: the holder must stop using the memory.

An Acquire interrupted in flight (Ctrl-C, a task cancelled, its deadline) may have been granted
by the broker without the reply ever arriving. Before the interruption propagates, the same
request (same client_request_id, no waiting) is sent again: the broker answers with that lease
if it was granted, which is then released at once, instead of leaking until its TTL.

`AsyncGpuLease` is the same for asyncio code (`async with AsyncGpuLease(mb=...)`).
`loadmaster gpu lease -- COMMAND` is built on `GpuLease`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import grpc

from loadmaster.common.errors import (
    CancelledError_,
    ExpiredError,
    FailedPreconditionError,
    LoadmasterError,
    ResourceExhaustedError,
    UnavailableError,
    from_grpc_error,
)
from loadmaster.common.grpc_client import CLIENT_OPTIONS  # reconnects within 2 s of a broker restart
from loadmaster.v1 import gpu_broker_pb2 as pb
from loadmaster.v1 import gpu_broker_pb2_grpc

__all__ = ["DEFAULT_BROKER", "AsyncGpuLease", "GpuLease", "LeaseLostError", "LeaseSpec"]

log = logging.getLogger(__name__)

DEFAULT_BROKER = "127.0.0.1:50053"
_CALL_TIMEOUT_S = 10.0
_ACQUIRE_ATTEMPTS = 3  # UNAVAILABLE is retried with the same client_request_id (idempotent)
_CLEANUP_TIMEOUT_S = 5.0  # for the replay + release after an interrupted Acquire


class LeaseLostError(FailedPreconditionError):
    """The broker no longer holds this lease for us: stop using its memory."""


@dataclass(frozen=True, slots=True)
class LeaseSpec:
    """What to ask the broker for. Shared by the sync and async leases and the CLI."""

    mb: int
    gpus: Sequence[int] = ()
    node: str = ""
    ttl_s: float = 30.0
    wait_s: float = 0.0
    priority: int = 0
    allow_split: bool = False
    holder: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)

    def acquire_request(self, client_request_id: str) -> pb.AcquireRequest:
        if self.mb <= 0:
            raise ValueError(f"mb must be > 0, got {self.mb}")
        if self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s}")
        labels = {"pid": str(os.getpid()), "host": socket.gethostname(), **self.labels}
        return pb.AcquireRequest(
            client_request_id=client_request_id,
            holder=self.holder or f"{socket.gethostname()}:{os.getpid()}",
            node=self.node,
            mb=self.mb,
            gpus=list(self.gpus),
            allow_split=self.allow_split,
            ttl_s=self.ttl_s,
            labels=labels,
            wait_s=self.wait_s,
            priority=self.priority,
        )

    @property
    def renew_every_s(self) -> float:
        return max(0.05, self.ttl_s / 3)

    def call_timeout_s(self) -> float:
        return self.wait_s + _CALL_TIMEOUT_S


class _LeaseView:
    """Read-only views of the granted lease, shared by both context managers."""

    _lease: pb.Lease | None
    _lost: threading.Event

    @property
    def lease(self) -> pb.Lease:
        if self._lease is None:
            raise RuntimeError("the lease is not held (enter the context manager first)")
        return self._lease

    @property
    def lease_id(self) -> str:
        return self.lease.lease_id

    @property
    def fencing_token(self) -> int:
        return self.lease.fencing_token

    @property
    def node(self) -> str:
        return self.lease.node

    @property
    def mb_per_gpu(self) -> dict[int, int]:
        return dict(self.lease.mb_per_gpu)

    @property
    def gpus(self) -> list[int]:
        return sorted(self.lease.mb_per_gpu)

    @property
    def cuda_visible_devices(self) -> str:
        """For CUDA_VISIBLE_DEVICES (indexes as NVML numbers them: set CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
        return ",".join(map(str, self.gpus))

    @property
    def lost(self) -> bool:
        return self._lost.is_set()


def _is_lost(error: LoadmasterError) -> bool:
    return isinstance(error, FailedPreconditionError)


def _maybe_granted(error: BaseException) -> bool:
    """Whether an Acquire that ended with `error` may have been granted without us seeing it:
    interrupted (not a broker answer at all), cancelled, or past its deadline."""
    return not isinstance(error, LoadmasterError) or isinstance(error, CancelledError_ | ExpiredError)


def _replay(request: pb.AcquireRequest) -> pb.AcquireRequest:
    """`request` again, not waiting: the lease it got if it was granted, else (at most) a new one."""
    replay = pb.AcquireRequest()
    replay.CopyFrom(request)
    replay.wait_s = 0
    return replay


def _log_cleanup_failure(request: pb.AcquireRequest, error: LoadmasterError) -> None:
    if not isinstance(error, ResourceExhaustedError | FailedPreconditionError):  # nothing is held
        log.warning(
            "could not release what interrupted acquire %s may have been granted "
            "(it expires by itself after its TTL): %s",
            request.client_request_id,
            error,
        )


class GpuLease(_LeaseView):
    """A lease held for the duration of a `with` block; renewed by a daemon thread."""

    def __init__(
        self,
        mb: int,
        *,
        address: str = DEFAULT_BROKER,
        gpus: Sequence[int] = (),
        node: str = "",
        ttl_s: float = 30.0,
        wait_s: float = 0.0,
        priority: int = 0,
        allow_split: bool = False,
        holder: str = "",
        labels: Mapping[str, str] | None = None,
        on_lost: Callable[[LoadmasterError], None] | None = None,
    ) -> None:
        self.spec = LeaseSpec(
            mb=mb,
            gpus=tuple(gpus),
            node=node,
            ttl_s=ttl_s,
            wait_s=wait_s,
            priority=priority,
            allow_split=allow_split,
            holder=holder,
            labels=dict(labels or {}),
        )
        self._address = address
        self._on_lost = on_lost
        self._lease = None
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._channel: grpc.Channel | None = None
        self._stub: gpu_broker_pb2_grpc.GpuBrokerStub | None = None
        self._thread: threading.Thread | None = None

    def acquire(self) -> pb.Lease:
        """Acquire (raises the broker's error as a `LoadmasterError`) and start renewing.
        If interrupted (e.g. KeyboardInterrupt), releases what the call may have been granted
        (see the module docstring), then re-raises."""
        request = self.spec.acquire_request(uuid.uuid4().hex)
        self._channel = grpc.insecure_channel(self._address, options=CLIENT_OPTIONS)
        self._stub = gpu_broker_pb2_grpc.GpuBrokerStub(self._channel)
        try:
            reply = self._acquire_with_retries(self._stub, request)
        except BaseException as error:
            if _maybe_granted(error):
                self._release_unseen_grant(self._stub, request)
            self._close_channel()
            raise
        self._lease = reply.lease
        self._thread = threading.Thread(target=self._renew_loop, name="gpu-lease-renew", daemon=True)
        self._thread.start()
        return reply.lease

    def _acquire_with_retries(
        self, stub: gpu_broker_pb2_grpc.GpuBrokerStub, request: pb.AcquireRequest
    ) -> pb.AcquireResponse:
        attempt = 0
        while True:
            try:
                return stub.Acquire(request, timeout=self.spec.call_timeout_s())
            except grpc.RpcError as raw:
                error = from_grpc_error(raw)
                if not isinstance(error, UnavailableError) or attempt == _ACQUIRE_ATTEMPTS - 1:
                    raise error from None
                self._stop.wait(0.2 * 2**attempt)
                attempt += 1

    @staticmethod
    def _release_unseen_grant(stub: gpu_broker_pb2_grpc.GpuBrokerStub, request: pb.AcquireRequest) -> None:
        try:
            lease = stub.Acquire(_replay(request), timeout=_CLEANUP_TIMEOUT_S).lease
            stub.Release(
                pb.ReleaseRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token),
                timeout=_CLEANUP_TIMEOUT_S,
            )
        except grpc.RpcError as raw:
            _log_cleanup_failure(request, from_grpc_error(raw))

    def release(self) -> bool:
        """Stop renewing and release; True when the broker freed it. Never raises."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=_CALL_TIMEOUT_S)
            self._thread = None
        released = False
        if self._lease is not None and self._stub is not None and not self.lost:
            try:
                reply = self._stub.Release(
                    pb.ReleaseRequest(lease_id=self._lease.lease_id, fencing_token=self._lease.fencing_token),
                    timeout=_CALL_TIMEOUT_S,
                )
                released = reply.released
            except grpc.RpcError as raw:
                log.warning(
                    "release of lease %s failed (it expires by itself): %s",
                    self._lease.lease_id,
                    from_grpc_error(raw),
                )
        self._close_channel()
        return released

    def _renew_loop(self) -> None:
        assert self._stub is not None and self._lease is not None
        while not self._stop.wait(self.spec.renew_every_s):
            try:
                reply = self._stub.Renew(
                    pb.RenewRequest(
                        lease_id=self._lease.lease_id,
                        fencing_token=self._lease.fencing_token,
                        ttl_s=self.spec.ttl_s,
                    ),
                    timeout=min(_CALL_TIMEOUT_S, self.spec.renew_every_s),
                )
                self._lease = reply.lease
            except grpc.RpcError as raw:
                error = from_grpc_error(raw)
                if _is_lost(error):
                    self._mark_lost(error)
                    return
                log.warning("renewing lease %s failed, will retry: %s", self._lease.lease_id, error)
            except Exception:  # the loop never dies while the lease is held
                log.exception("renewing lease %s failed", self._lease.lease_id)

    def _mark_lost(self, error: LoadmasterError) -> None:
        log.error("lease %s lost: %s", self.lease_id, error)
        self._lost.set()
        if self._on_lost is not None:
            try:
                self._on_lost(LeaseLostError(str(error)))
            except Exception:
                log.exception("on_lost callback failed")

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
            self._stub = None

    def __enter__(self) -> GpuLease:
        self.acquire()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class AsyncGpuLease(_LeaseView):
    """`async with AsyncGpuLease(mb=...) as lease:` — renewed by a task on the running loop."""

    def __init__(
        self,
        mb: int,
        *,
        address: str = DEFAULT_BROKER,
        on_lost: Callable[[LoadmasterError], None] | None = None,
        **spec: Any,
    ) -> None:
        self.spec = LeaseSpec(mb=mb, **spec)
        self._address = address
        self._on_lost = on_lost
        self._lease = None
        self._lost = threading.Event()
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AsyncGpuLease:
        request = self.spec.acquire_request(uuid.uuid4().hex)
        self._channel = grpc.aio.insecure_channel(self._address, options=CLIENT_OPTIONS)
        stub = gpu_broker_pb2_grpc.GpuBrokerStub(self._channel)
        try:
            reply = await self._acquire_with_retries(stub, request)
        except BaseException as error:  # asyncio.CancelledError included
            if _maybe_granted(error):
                await self._release_unseen_grant(stub, request)
            await self._channel.close()
            raise
        self._lease = reply.lease
        self._task = asyncio.create_task(self._renew_loop(stub), name="gpu-lease-renew")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        assert self._channel is not None
        if self._lease is not None and not self.lost:
            stub = gpu_broker_pb2_grpc.GpuBrokerStub(self._channel)
            try:
                await stub.Release(
                    pb.ReleaseRequest(lease_id=self._lease.lease_id, fencing_token=self._lease.fencing_token),
                    timeout=_CALL_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as raw:
                log.warning(
                    "release of lease %s failed (it expires by itself): %s",
                    self._lease.lease_id,
                    from_grpc_error(raw),
                )
        await self._channel.close()

    async def _acquire_with_retries(
        self, stub: gpu_broker_pb2_grpc.GpuBrokerStub, request: pb.AcquireRequest
    ) -> pb.AcquireResponse:
        attempt = 0
        while True:
            try:
                return await stub.Acquire(request, timeout=self.spec.call_timeout_s())
            except grpc.aio.AioRpcError as raw:
                error = from_grpc_error(raw)
                if not isinstance(error, UnavailableError) or attempt == _ACQUIRE_ATTEMPTS - 1:
                    raise error from None
                await asyncio.sleep(0.2 * 2**attempt)
                attempt += 1

    @staticmethod
    async def _release_unseen_grant(
        stub: gpu_broker_pb2_grpc.GpuBrokerStub, request: pb.AcquireRequest
    ) -> None:
        try:
            lease = (await stub.Acquire(_replay(request), timeout=_CLEANUP_TIMEOUT_S)).lease
            await stub.Release(
                pb.ReleaseRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token),
                timeout=_CLEANUP_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as raw:
            _log_cleanup_failure(request, from_grpc_error(raw))

    async def _renew_loop(self, stub: gpu_broker_pb2_grpc.GpuBrokerStub) -> None:
        assert self._lease is not None
        while True:
            await asyncio.sleep(self.spec.renew_every_s)
            try:
                reply = await stub.Renew(
                    pb.RenewRequest(
                        lease_id=self._lease.lease_id,
                        fencing_token=self._lease.fencing_token,
                        ttl_s=self.spec.ttl_s,
                    ),
                    timeout=min(_CALL_TIMEOUT_S, self.spec.renew_every_s),
                )
                self._lease = reply.lease
            except grpc.aio.AioRpcError as raw:
                error = from_grpc_error(raw)
                if _is_lost(error):
                    log.error("lease %s lost: %s", self._lease.lease_id, error)
                    self._lost.set()
                    if self._on_lost is not None:
                        self._on_lost(LeaseLostError(str(error)))
                    return
                log.warning("renewing lease %s failed, will retry: %s", self._lease.lease_id, error)
            except Exception:
                log.exception("renewing lease %s failed", self._lease.lease_id)
