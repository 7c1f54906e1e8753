"""Room for a load: the lease it needs, evicting idle models one at a time until it fits.

    room = Room(lease_client, residents=pool_residents, evict=pool_evict, clock=clock, ...)
    lease = await room.acquire(model_id, priority, mb=400, device="cuda:0")
    room.changed()   # a request finished, a model became READY or gave its lease back

Loads take room one at a time (a lock), so two loads never evict for each other. When
the broker says no, `eviction.choose_victim` picks the next model to unload; when
nothing may go yet but something will (a busy or young model, one still loading, one
unloading), the load waits for `changed()` or a young model's coming of age, up to
`wait_s`; then it fails with an error that names what holds the memory and why.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from loadmaster.common.clock import Clock
from loadmaster.common.errors import ResourceExhaustedError
from loadmaster.model_pool._waiting import event_or_timeout
from loadmaster.model_pool.eviction import Incoming, Resident, choose_victim, no_room_message
from loadmaster.model_pool.leases import Lease, LeaseClient, gpus_for_device

__all__ = ["Room"]

log = logging.getLogger(__name__)


class Room:
    def __init__(
        self,
        lease_client: LeaseClient,
        *,
        residents: Callable[[], list[Resident]],
        evict: Callable[[str, str], Awaitable[None]],
        clock: Clock,
        ttl_s: float,
        wait_s: float,
        allow_split: bool,
    ) -> None:
        self._lease_client = lease_client
        self._residents = residents  # READY models, and those settling (loading with a lease, unloading)
        self._evict = evict  # (victim, model it makes room for)
        self._clock = clock
        self._ttl_s = ttl_s
        self._wait_s = wait_s
        self._allow_split = allow_split
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()

    def changed(self) -> None:
        """Something that may free room happened: a waiting load looks again."""
        self._changed.set()

    async def acquire(self, model_id: str, priority: int, *, mb: int, device: str) -> Lease:
        gpus = gpus_for_device(device)
        labels = {"model": model_id}
        async with self._lock:
            deadline = self._clock.monotonic() + self._wait_s
            while True:
                try:
                    return await self._lease_client.acquire(
                        mb=mb, ttl_s=self._ttl_s, labels=labels, gpus=gpus
                    )
                except ResourceExhaustedError as exhausted:
                    broker_says = exhausted.message
                residents = self._residents()
                now = self._clock.monotonic()
                choice = choose_victim(residents, incoming=Incoming(model_id, priority, tuple(gpus)), now=now)
                if choice.victim is not None:
                    await self._evict(choice.victim, model_id)
                    continue
                if choice.worth_waiting and now < deadline:
                    log.info("load of %s waits for %s", model_id, ", ".join(choice.waiting))
                    await self._wait(residents, deadline=deadline, now=now)
                    continue
                if self._allow_split and not gpus:
                    try:  # too big for any single GPU: one atomic lease over several
                        return await self._lease_client.acquire(
                            mb=mb, ttl_s=self._ttl_s, labels=labels, gpus=gpus, allow_split=True
                        )
                    except ResourceExhaustedError:
                        pass
                raise ResourceExhaustedError(
                    f"{no_room_message(model_id, mb, choice, residents)} ({broker_says})"
                )

    async def _wait(self, residents: list[Resident], *, deadline: float, now: float) -> None:
        """Until `changed()`, a young model comes of age, or `deadline`."""
        wake_at = deadline
        for r in residents:
            if r.state == "ready" and r.inflight == 0 and now - r.loaded_at < r.min_resident_s:
                wake_at = min(wake_at, r.loaded_at + r.min_resident_s)
        self._changed.clear()
        await event_or_timeout(self._changed, self._clock, wake_at - now)
