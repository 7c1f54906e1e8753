"""Room for a load: the lease it needs, evicting idle models one at a time until it fits.

    room = Room(lease_client, residents=pool_residents, evict=pool_evict, clock=clock, ...)
    lease = await room.acquire(model_id, priority, mb=400, device="cuda:0")
    room.changed()   # a request finished, a model became READY or gave its lease back

Loads take room one at a time (a lock), so two loads never evict for each other. When
the broker says no, `eviction.plan_evictions` (given the broker's free memory per GPU)
picks the models whose unloads together make room, and none when no evictions could (then
the load fails at once, and nothing was unloaded for it). When nothing may go yet but
waiting would make room (a busy or young model, one still loading, one unloading), the load
waits for `changed()` or a young model's coming of age, up to `wait_s`; then it fails with
an error that names what holds the memory and why.

The warm bump (eviction.WarmBump, docs/vram-gate.md): for `bump_s` from the start of a load,
models of its priority that are in use keep serving and the load waits for them; after
that they are drained and evicted. The load's wait is `bump_s` + `wait_s` in all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from loadmaster.common.clock import Clock
from loadmaster.common.errors import LoadmasterError, ResourceExhaustedError
from loadmaster.model_pool._waiting import event_or_timeout
from loadmaster.model_pool.eviction import (
    EvictionPlan,
    Incoming,
    Resident,
    WarmBump,
    choose_victim,
    no_room_message,
    plan_evictions,
)
from loadmaster.model_pool.leases import Lease, LeaseClient, gpus_for_device

__all__ = ["Room", "may_fit_later"]

# The broker's words for a request larger than the GPU could ever give (gpu_broker manager.py).
_NEVER_FITS = "can never fit"


def may_fit_later(refusal: ResourceExhaustedError) -> bool:
    """A refusal for memory that memory freed later could cure (not a model too big for the GPU)."""
    return _NEVER_FITS not in refusal.message


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
        bump_s: float = 0.0,
        bump_idle_s: float = 0.0,
    ) -> None:
        self._lease_client = lease_client
        self._residents = residents  # READY models, and those settling (loading with a lease, unloading)
        self._evict = evict  # (victim, model it makes room for)
        self._clock = clock
        self._ttl_s = ttl_s
        self._wait_s = wait_s
        self._allow_split = allow_split
        self._bump_s = bump_s  # the warm bump's bound
        self._bump_idle_s = bump_idle_s  # a model used this recently is still in use
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()

    def changed(self) -> None:
        """Something that may free room happened: a waiting load looks again."""
        self._changed.set()

    async def acquire(self, model_id: str, priority: int, *, mb: int, device: str) -> Lease:
        gpus = gpus_for_device(device)
        labels = {"model": model_id}
        bump = (
            WarmBump(until=self._clock.monotonic() + self._bump_s, idle_s=self._bump_idle_s)
            if self._bump_s > 0
            else None
        )
        async with self._lock:
            deadline = max(self._clock.monotonic(), bump.until if bump else 0.0) + self._wait_s
            raced = 0  # the broker refused what its inventory then showed free
            while True:
                try:
                    return await self._lease_client.acquire(
                        mb=mb, ttl_s=self._ttl_s, labels=labels, gpus=gpus
                    )
                except ResourceExhaustedError as exhausted:
                    broker_says = exhausted.message
                residents = self._residents()
                now = self._clock.monotonic()
                incoming = Incoming(model_id, priority, tuple(gpus))
                plan = await self._plan(
                    residents, incoming, mb=mb, now=now, split=self._allow_split and not gpus, bump=bump
                )
                choice = (
                    plan.choice
                    if plan is not None
                    else choose_victim(residents, incoming=incoming, now=now, bump=bump)
                )
                if plan is None and choice.victim is not None:  # no inventory: one victim at a time
                    await self._evict(choice.victim, model_id)
                    continue
                if plan is not None and plan.victims:
                    log.info("load of %s evicts %s", model_id, ", ".join(plan.victims))
                    for victim in plan.victims:
                        await self._evict(victim, model_id)
                    continue
                if plan is not None and plan.fits_now and raced < 3:
                    raced += 1
                    continue
                waiting = choice.worth_waiting if plan is None else plan.worth_waiting
                if waiting and now < deadline:
                    log.info("load of %s waits for %s", model_id, ", ".join(choice.waiting))
                    await self._wait(residents, deadline=deadline, now=now, bump=bump)
                    continue
                if self._allow_split and not gpus:
                    try:  # too big for any single GPU: one atomic lease over several
                        return await self._lease_client.acquire(
                            mb=mb, ttl_s=self._ttl_s, labels=labels, gpus=gpus, allow_split=True
                        )
                    except ResourceExhaustedError:
                        pass
                futile = "; evicting every evictable model would not make room" if plan is not None else ""
                raise ResourceExhaustedError(
                    f"{no_room_message(model_id, mb, choice, residents)}{futile} ({broker_says})"
                )

    async def _plan(
        self,
        residents: list[Resident],
        incoming: Incoming,
        *,
        mb: int,
        now: float,
        split: bool,
        bump: WarmBump | None,
    ) -> EvictionPlan | None:
        """The evictions that make room, from the broker's free memory; None without it."""
        try:
            free = await self._lease_client.free_mb()
        except LoadmasterError as error:
            log.warning("no GPU inventory from the broker (%s); evicting one model at a time", error)
            return None
        return plan_evictions(
            residents, incoming=incoming, mb=mb, free_mb=free, now=now, split=split, bump=bump
        )

    async def _wait(
        self, residents: list[Resident], *, deadline: float, now: float, bump: WarmBump | None
    ) -> None:
        """Until `changed()`, a young model comes of age, an idle model stops counting as in
        use, the warm bump ends, or `deadline`."""
        wake_at = deadline
        if bump is not None and now < bump.until:
            wake_at = min(wake_at, bump.until)
        for r in residents:
            if r.state == "ready" and r.inflight == 0 and now - r.loaded_at < r.min_resident_s:
                wake_at = min(wake_at, r.loaded_at + r.min_resident_s)
            idle_from = r.last_used + bump.idle_s if bump is not None else 0.0
            if bump is not None and r.state == "ready" and r.inflight == 0 and now < idle_from < bump.until:
                wake_at = min(wake_at, idle_from)
        self._changed.clear()
        await event_or_timeout(self._changed, self._clock, wake_at - now)
