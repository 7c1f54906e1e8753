"""GPU memory leases for training jobs and tools: `with GpuLease(mb=4096) as lease: ...`.

The lease is acquired from the gpu-broker on entry, renewed while the block runs, and
released on exit, also when the block raises. Renewals run on a thread of their own
(`LeaseKeeper`, with its own event loop and channel), so a busy caller never makes them late.
The lease is `lost` once the broker says it is gone, or once no renewal succeeded before the
holder's deadline (`LeaseTiming`: before the broker could give the memory to anyone else);
`on_lost` is then called (on the keeper's thread): the holder must stop using the memory.
With `reacquire=True` a lease the broker lost (say its Redis lost its data) is acquired again
under a new id and fencing token instead (`lease_id` / `fencing_token` then change).

An Acquire interrupted in flight (Ctrl-C, a task cancelled, its deadline) may have been granted
by the broker without the reply ever arriving. Before the interruption propagates, the same
request (same client_request_id, no waiting) is sent again: the broker answers with that lease
if it was granted, which is then released at once, instead of leaking until its TTL.

`AsyncGpuLease` is the same for asyncio code (`async with AsyncGpuLease(mb=...)`).
`loadmaster gpu lease -- COMMAND` is built on `GpuLease`. All of them, and the model pool, talk
to the broker through the one `AsyncLeaseClient` (lease_client.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from loadmaster.client.lease_client import (
    DEFAULT_BROKER,
    AsyncLeaseClient,
    Lease,
    LeaseClient,
    LeaseLostError,
    default_holder,
)
from loadmaster.client.lease_keeper import LeaseKeeper
from loadmaster.common.errors import LoadmasterError

__all__ = ["DEFAULT_BROKER", "AsyncGpuLease", "GpuLease", "LeaseLostError", "LeaseSpec"]

log = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 10.0
_CLEANUP_TIMEOUT_S = 12.0  # for the replay + release after an interrupted Acquire
_KEY = "lease"


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

    def client(self, address: str) -> AsyncLeaseClient:
        return AsyncLeaseClient(address, holder=self.holder or default_holder(), node=self.node)

    async def acquire(self, client: LeaseClient) -> Lease:
        if self.mb <= 0:
            raise ValueError(f"mb must be > 0, got {self.mb}")
        if self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s}")
        assert isinstance(client, AsyncLeaseClient)
        return await client.acquire(
            mb=self.mb,
            ttl_s=self.ttl_s,
            labels=dict(self.labels),
            gpus=list(self.gpus),
            allow_split=self.allow_split,
            wait_s=self.wait_s,
            priority=self.priority,
        )


class _KeptLease:
    """The lease of one `with` block, kept by a `LeaseKeeper`; shared by both context managers."""

    def __init__(
        self,
        spec: LeaseSpec,
        *,
        address: str,
        on_lost: Callable[[LoadmasterError], None] | None,
        reacquire: bool,
    ) -> None:
        self.spec = spec
        self._address = address
        self._on_lost = on_lost
        self._lease: Lease | None = None
        self._lost = threading.Event()
        self._keeper = LeaseKeeper(
            lambda: spec.client(address),
            on_lost=self._mark_lost,
            reacquire=reacquire,
            name="gpu-lease-keeper",
        )

    # ---- views -----------------------------------------------------------------

    @property
    def lease(self) -> Lease:
        lease = self._keeper.lease(_KEY) or self._lease
        if lease is None:
            raise RuntimeError("the lease is not held (enter the context manager first)")
        return lease

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
        return self.lease.gpus

    @property
    def cuda_visible_devices(self) -> str:
        """For CUDA_VISIBLE_DEVICES (indexes as NVML numbers them: set CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
        return ",".join(map(str, self.gpus))

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    @property
    def live(self) -> bool:
        """Whether the lease is certainly ours right now (renewed within the holder's deadline)."""
        return self._keeper.live(_KEY)

    # ---- shared steps ------------------------------------------------------------

    def _begin(self) -> tuple[concurrent.futures.Future[Lease], threading.Event]:
        self._keeper.start()
        finished = threading.Event()
        spec = self.spec

        async def work(client: LeaseClient) -> Lease:
            try:
                return await spec.acquire(client)
            finally:
                finished.set()

        return self._keeper.run(work), finished

    def _granted(self, lease: Lease) -> None:
        self._lease = lease
        self._keeper.keep(_KEY, lease, ttl_s=self.spec.ttl_s)

    def _release_future(self) -> concurrent.futures.Future[bool] | None:
        lease = self._keeper.forget(_KEY) or self._lease
        if lease is None or self.lost:
            return None

        async def work(client: LeaseClient) -> bool:
            try:
                await client.release(lease)
                return True
            except LoadmasterError as error:
                log.warning("release of lease %s failed (it expires by itself): %s", lease.lease_id, error)
                return False

        return self._keeper.run(work)

    def _mark_lost(self, key: str, lease: Lease, error: LoadmasterError) -> None:
        self._lost.set()
        if self._on_lost is not None:
            try:
                self._on_lost(error if isinstance(error, LeaseLostError) else LeaseLostError(str(error)))
            except Exception:
                log.exception("on_lost callback failed")


class GpuLease(_KeptLease):
    """A lease held for the duration of a `with` block; renewed by the keeper's thread."""

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
        reacquire: bool = False,
    ) -> None:
        spec = LeaseSpec(
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
        super().__init__(spec, address=address, on_lost=on_lost, reacquire=reacquire)

    def acquire(self) -> Lease:
        """Acquire (raises the broker's error as a `LoadmasterError`) and start renewing.
        If interrupted (e.g. KeyboardInterrupt), releases what the call may have been granted
        (see the module docstring), then re-raises."""
        future, finished = self._begin()
        try:
            lease = future.result()
        except BaseException:
            if future.cancel():  # interrupted here: the keeper's task cleans up, then ends
                finished.wait(_CLEANUP_TIMEOUT_S)
            self._keeper.close()
            raise
        self._granted(lease)
        return lease

    def release(self) -> bool:
        """Stop renewing and release; True when the broker took it back. Never raises."""
        released = False
        future = self._release_future()
        if future is not None:
            try:
                released = future.result(_CALL_TIMEOUT_S)
            except Exception as error:
                log.warning("release of lease %s failed (it expires by itself): %s", self._lease, error)
        self._keeper.close()
        return released

    def __enter__(self) -> GpuLease:
        self.acquire()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class AsyncGpuLease(_KeptLease):
    """`async with AsyncGpuLease(mb=...) as lease:` — renewed by the keeper's thread, so a
    blocked event loop never makes a renewal late."""

    def __init__(
        self,
        mb: int,
        *,
        address: str = DEFAULT_BROKER,
        on_lost: Callable[[LoadmasterError], None] | None = None,
        reacquire: bool = False,
        **spec: Any,
    ) -> None:
        super().__init__(LeaseSpec(mb=mb, **spec), address=address, on_lost=on_lost, reacquire=reacquire)

    async def __aenter__(self) -> AsyncGpuLease:
        future, finished = await asyncio.to_thread(self._begin)
        try:
            lease = await asyncio.wrap_future(future)
        except BaseException:  # asyncio.CancelledError included: the keeper's task cleans up
            future.cancel()
            await asyncio.to_thread(finished.wait, _CLEANUP_TIMEOUT_S)
            await asyncio.to_thread(self._keeper.close)
            raise
        self._granted(lease)
        return self

    async def __aexit__(self, *exc: object) -> None:
        future = self._release_future()
        if future is not None:
            try:
                await asyncio.wait_for(asyncio.wrap_future(future), _CALL_TIMEOUT_S)
            except Exception as error:
                log.warning("release of lease %s failed (it expires by itself): %s", self._lease, error)
        await asyncio.to_thread(self._keeper.close)
