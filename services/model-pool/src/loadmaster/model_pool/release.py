"""Giving back what a model holds, and reacting when it is taken away: the release half of
`ModelPool` (see pool.py), as a base class it inherits. Frees a failed load's engines and
lease, waits for NVML to show an unloaded model's memory gone, releases leases, and unloads a
model whose lease was lost or whose engine failed (a replaced lease is recorded in place)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from loadmaster.common.clock import Clock
from loadmaster.common.errors import LoadmasterError, ResourceExhaustedError
from loadmaster.model_pool import memory
from loadmaster.model_pool.admission import _Loaded
from loadmaster.model_pool.batcher import Instance
from loadmaster.model_pool.eviction import EvictionCounters
from loadmaster.model_pool.instances import free_instances
from loadmaster.model_pool.leases import Lease, LeaseClient, WorkerLeases
from loadmaster.model_pool.room import may_fit_later
from loadmaster.model_pool.slots import ModelState, Slot, SlotStatus

log = logging.getLogger("loadmaster.model_pool.pool")


class _Release:
    """Lease release and the lease keeper's and engines' bad news, for `ModelPool`."""

    counters: EvictionCounters
    _background: set[asyncio.Task[Any]]
    _clock: Clock
    _keeper: WorkerLeases
    _lease_client: LeaseClient
    _loaded: dict[str, _Loaded]
    _slots: dict[str, Slot]

    async def unload(self, model_id: str, *, reason: str = "") -> SlotStatus:
        raise NotImplementedError

    def _changed(self, slot: Slot) -> None:
        raise NotImplementedError

    def _record(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        raise NotImplementedError

    async def _abandon_load(
        self,
        model_id: str,
        error: BaseException,
        *,
        instances: list[Instance],
        lease: Lease | None,
    ) -> str:
        """Free what a failed load took (engines, threads, lease); returns the error text."""
        if isinstance(error, ResourceExhaustedError) and may_fit_later(error):
            message = error.message  # no memory yet: the scheduler's VRAM gate retries (not an error)
            log.info("loading model %s found no room: %s", model_id, message)
        elif isinstance(error, LoadmasterError):
            message = error.message
            log.error("loading model %s failed: %s", model_id, message)
        else:
            message = f"loading model '{model_id}' failed: {type(error).__name__}: {error}"
            log.error("loading model %s failed", model_id, exc_info=error)
        await free_instances(model_id, instances)
        held = self._keeper.forget(model_id) or lease
        if held is not None:
            await self._release(model_id, held)
        return message

    async def _memory_freed(self, model_id: str, loaded: _Loaded) -> None:
        """On NVIDIA: wait (bounded) until NVML shows the model's memory gone from this process."""
        if loaded.memory_before and loaded.lease is not None and not await memory.wait_freed(
            loaded.memory_before, dict(loaded.lease.mb_per_gpu), clock=self._clock
        ):
            log.warning(
                "NVML still shows memory of %s held after unload; releasing its lease anyway", model_id
            )

    async def _release(self, model_id: str, lease: Lease) -> None:
        try:
            await self._lease_client.release(lease)
        except Exception as error:
            log.warning(
                "releasing lease %s of %s failed (it expires by TTL): %s", lease.lease_id, model_id, error
            )

    def _on_lease_lost(self, model_id: str, lease: Lease, error: LoadmasterError) -> None:
        """On the loop, after the keeper dropped the lease: the model is already not served
        (the batcher checks `live` before each engine call); now unload it and say why."""
        loaded = self._loaded.get(model_id)
        if loaded is None:
            return  # still loading: the load sees the lease gone and fails
        if loaded.lease is None or loaded.lease.lease_id != lease.lease_id:
            return  # a late word about an earlier lease: the model was loaded again under another
        self._record("evictions", 1.0, {"model": model_id, "reason": "lease_lost"})
        self.counters.evicted(model_id, "lease_lost")
        task = asyncio.create_task(
            self.unload(model_id, reason=f"lease {lease.lease_id} lost; stopped serving ({error.message})"),
            name=f"lease-lost-{model_id}",
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def engine_failed(self, model_id: str, generation: int, reason: str) -> None:
        """A loaded engine can no longer serve (a generative engine's batching thread died):
        unload it, so the model is not left READY failing every request; the scheduler loads
        it again when requests wait. A report about an earlier load is ignored."""
        slot = self._slots.get(model_id)
        if slot is None or slot.state is not ModelState.READY or slot.generation != generation:
            return
        log.error("model %s failed (%s); unloading it", model_id, reason)
        task = asyncio.create_task(
            self.unload(model_id, reason=f"engine failed: {reason}"), name=f"engine-failed-{model_id}"
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _on_lease_replaced(self, model_id: str, old: Lease, new: Lease) -> None:
        """On the loop: the broker lost `old` and granted the same memory again as `new`."""
        self._record("leases_reestablished", 1.0, {"model": model_id})
        loaded = self._loaded.get(model_id)
        if loaded is not None:
            loaded.lease = new
        slot = self._slots[model_id]
        if slot.lease_id == old.lease_id:
            slot.lease_id = new.lease_id
            self._changed(slot)
