"""The worker's lease policy. The lease client and keeper themselves are the SDK's
(`loadmaster.client.lease_client` / `lease_keeper`), shared with `GpuLease` and the CLI.

What this worker does with its leases:

- every READY or loading model's lease is renewed by a `LeaseKeeper` on a thread of its own
  (its own event loop and gRPC channel), so a blocked worker loop never makes a renewal late;
- a model is served only while its lease is `live` (checked by the batcher on the engine's
  thread before every engine call, and at the door);
- a lease the broker says is gone (say Redis lost its data) is acquired again, on the same
  GPUs with the same memory and a new fencing token, and the model stays loaded;
- a lease that lapsed (no renewal before the holder's deadline) or could not be acquired
  again stops its model: it is no longer served at once, then unloaded on the worker's loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from loadmaster.client.lease_client import AsyncLeaseClient, Lease, LeaseClient, LeaseLostError
from loadmaster.client.lease_keeper import LeaseKeeper
from loadmaster.common.errors import LoadmasterError

__all__ = [
    "AsyncLeaseClient",
    "Lease",
    "LeaseClient",
    "LeaseLostError",
    "WorkerLeases",
    "device_for_lease",
    "gpus_for_device",
]

log = logging.getLogger(__name__)


def gpus_for_device(device: str) -> list[int]:
    """The GPUs to ask the broker for: `cuda:N` -> [N]; `cuda` / `cpu` -> any."""
    kind, _, index = device.partition(":")
    return [int(index)] if kind == "cuda" and index else []


def device_for_lease(device: str, lease: Lease) -> str:
    """`cuda` (any GPU) becomes the GPU the broker granted; explicit devices stay as they are."""
    if device == "cuda":
        return f"cuda:{lease.gpus[0]}" if lease.gpus else "cuda:0"
    return device


class WorkerLeases:
    """The models' leases, kept on the keeper's thread; `on_lost` / `on_replaced` are called
    on the worker's event loop (the one that first called `keep`)."""

    def __init__(
        self,
        client: Callable[[], LeaseClient],
        *,
        ttl_s: float,
        on_lost: Callable[[str, Lease, LoadmasterError], None],
        on_replaced: Callable[[str, Lease, Lease], None],
        owns_client: bool,
    ) -> None:
        self.ttl_s = ttl_s
        self._on_lost = on_lost
        self._on_replaced = on_replaced
        self._loop: asyncio.AbstractEventLoop | None = None
        self._keeper = LeaseKeeper(
            client,
            on_lost=lambda key, lease, error: self._hand_over(self._on_lost, key, lease, error),
            on_replaced=lambda key, old, new: self._hand_over(self._on_replaced, key, old, new),
            reacquire=True,
            owns_client=owns_client,  # its thread keeps real time: a test's fake clock cannot drive it
            name="worker-lease-keeper",
        )

    def keep(self, model_id: str, lease: Lease) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._keeper.start()
        self._keeper.keep(model_id, lease, ttl_s=self.ttl_s)

    def forget(self, model_id: str) -> Lease | None:
        return self._keeper.forget(model_id)

    def lease(self, model_id: str) -> Lease | None:
        return self._keeper.lease(model_id)

    def live(self, model_id: str) -> bool:
        return self._keeper.live(model_id)

    async def close(self) -> None:
        await asyncio.to_thread(self._keeper.close)

    def _hand_over(self, handler: Callable[..., None], *args: object) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(handler, *args)
        except RuntimeError:
            log.warning("lease event for %s after the worker's loop closed", args[0])
