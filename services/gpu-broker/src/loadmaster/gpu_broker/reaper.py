"""The broker's background loop: register the local inventory (again whenever Redis lost it),
record memory used outside leases from NVML (when this host has GPUs), reap expired leases,
and report per-GPU gauges and the number of waiting acquires. Every replica runs one; the reap script makes
concurrent reaping safe. A step that fails is logged and the loop goes on.

On a host with GPUs a step runs every `interval_s` (NVML is sampled each step). Without
them it runs when the first lease expires, and at least every `idle_interval_s` (15 s): an
idle broker wakes a few times a minute instead of every second. (At 5 s, the steps were a
third of an idle broker's CPU: each costs a few ms of wake-ups and Redis round trips, while
held leases, renewed every ttl/3, never come due.) A lease this replica grants that expires
before the next step wakes the loop to plan again, so its expiry is not missed. A lease granted meanwhile by
another replica with an earlier expiry is reaped at this replica's next step; its memory is
reclaimed before that anyway, lazily, by the next Acquire. Gauges are reported every step,
not only when they change: the telemetry reporter drops what it cannot deliver (the metrics
service may start after the broker), and a dashboard needs a recent reading. They are also
reported shortly after this replica grants or releases leases (once per burst), so a model
load or unload shows on the dashboard at once rather than at the next step, up to 18 s later.

Redis may lose its data (FLUSHALL, a restart without persistence). Each step checks that
every node of the local inventory is still registered, and registers the missing ones again.
So does an Acquire or Inventory call that finds no GPU where it looked (`ensure_registered`,
through `LeaseManager.on_no_gpus`): the first request after the loss re-registers the
inventory and is served, instead of failing until the next step. A check that finds every
node in place costs one SMEMBERS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from loadmaster.common.clock import Clock
from loadmaster.common.errors import LoadmasterError
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.gpu_broker.leases import GpuState
from loadmaster.gpu_broker.manager import LeaseManager
from loadmaster.gpu_broker.nvml import NvmlSampler, proc_ancestors
from loadmaster.gpu_broker.reconcile import outside_per_gpu

__all__ = ["LocalGpus", "Reaper"]

log = logging.getLogger(__name__)

_AFTER_EXPIRY_S = 0.01
_MIN_DELAY_S = 0.05  # a lease that stays expired after a step (Redis trouble): no busy loop
_GAUGES_AFTER_CHANGE_S = 0.5  # grants and releases within this report the gauges once


@dataclass(frozen=True, slots=True)
class LocalGpus:
    """This host's GPUs, sampled through NVML each step to record memory used outside leases.

    `horizon_s` must exceed the step interval (see `reconcile.py`)."""

    node: str
    sampler: NvmlSampler
    reserve_mb: int
    horizon_s: float = 3.0


class Reaper:
    def __init__(
        self,
        manager: LeaseManager,
        *,
        clock: Clock,
        inventory: Mapping[str, Sequence[GpuState]],
        telemetry: TelemetryReporter | None = None,
        interval_s: float = 1.0,
        idle_interval_s: float = 15.0,
        slow_step_s: float = 0.5,
        rng: random.Random | None = None,
        local_gpus: LocalGpus | None = None,
    ) -> None:
        self._local_gpus = local_gpus
        self._manager = manager
        self._clock = clock
        self._inventory = dict(inventory)
        self._registered: set[str] = set()  # nodes this broker registered at least once
        self._check_failed = True  # the last registration check did not complete: step often
        self._registering = asyncio.Lock()  # one check at a time; callers that queue reuse it
        self._telemetry = telemetry
        self._interval_s = interval_s
        self._idle_interval_s = idle_interval_s
        self._slow_step_s = slow_step_s
        self._rng = rng or random.Random()
        self._task: asyncio.Task[None] | None = None
        self._replan = asyncio.Event()  # a grant expires before the next step
        self._gauges_soon: asyncio.Task[None] | None = None  # after a grant or release
        self._next_step_ms: int | None = None  # broker clock; None while planning it
        self._stepped_at_once = False  # the last step ran at once, for a lease already expired

    async def start(self) -> None:
        """Run one step now (so the inventory is registered before serving), then loop."""
        await self._guarded_step()
        self._manager.on_no_gpus(self._ensure_registered_for_request)
        self._manager.on_grant(self._granted)
        self._manager.on_release(self._gauges_after_change)
        self._task = asyncio.create_task(self._run(), name="gpu-broker-reaper")

    async def stop(self) -> None:
        for task in (self._task, self._gauges_soon):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._gauges_soon = None

    async def ensure_registered(self) -> list[str]:
        """Register each node of the local inventory that Redis does not hold (never
        registered yet, or lost with Redis's data); returns those nodes."""
        if not self._inventory:
            self._check_failed = False
            return []
        async with self._registering:
            self._check_failed = True
            present = await self._manager.registered_nodes()
            missing = [node for node in self._inventory if node not in present]
            for node in missing:
                gpus = list(self._inventory[node])
                local = self._local_gpus
                if local is not None and node == local.node:
                    # In the registration itself, before anything can be granted on them: memory
                    # in use there (by holders whose leases went with Redis's data, too) counts
                    # as used outside leases.
                    outside = await self._outside(local)
                    gpus = [replace(g, used_outside_mb=outside.get(g.index, g.used_outside_mb)) for g in gpus]
                registered = await self._manager.register_node(node, gpus)
                if node in self._registered:
                    log.warning(
                        "node %s was missing from Redis (its data was lost?): registered its %d GPU(s) again",
                        node,
                        len(registered),
                    )
                else:
                    log.info("registered node %s: %d GPU(s)", node, len(registered))
                self._registered.add(node)
            self._check_failed = False
            return missing

    async def _ensure_registered_for_request(self) -> bool:
        """For a request that found no GPU: True when the inventory is registered now, so the
        request may look again (also when a concurrent request did the registering)."""
        try:
            await self.ensure_registered()
            return bool(self._inventory)
        except LoadmasterError as error:  # the request reports what it found; the next step retries
            log.warning("re-registering the inventory failed: %s", error.message)
        except Exception:
            log.exception("re-registering the inventory failed")
        return False

    async def step(self) -> int:
        """Register what Redis lacks, reap, report gauges. Returns leases reaped."""
        await self.ensure_registered()
        if self._local_gpus is not None:  # before reaping: a dead holder's bytes stay unavailable
            await self._reconcile(self._local_gpus)
        reaped = await self._manager.reap()
        if reaped:
            log.info("reaped %d expired lease(s)", reaped)
        await self._report_gauges()
        return reaped

    async def _report_gauges(self) -> None:
        if self._telemetry is None:
            return
        for gpu in await self._manager.inventory():
            labels = {"node": gpu.node, "gpu": str(gpu.index)}
            self._telemetry.record("lease_mb", gpu.leased_mb, labels)
            self._telemetry.record("free_mb", gpu.free_mb, labels)
            self._telemetry.record("outside_mb", gpu.used_outside_mb, labels)
        self._telemetry.record("waiters", await self._manager.waiting())

    def _gauges_after_change(self) -> None:
        """Report the gauges `_GAUGES_AFTER_CHANGE_S` from now, unless already due by then."""
        if self._telemetry is not None and self._gauges_soon is None:
            self._gauges_soon = asyncio.create_task(self._gauges_soon_task(), name="gpu-broker-gauges")

    async def _gauges_soon_task(self) -> None:
        try:
            await self._clock.sleep(_GAUGES_AFTER_CHANGE_S)
            await self._report_gauges()
        except LoadmasterError as error:  # the next step reports them
            log.debug("gauges after a lease change not reported: %s", error.message)
        finally:
            self._gauges_soon = None

    async def _next_delay(self) -> float:
        jitter = self._rng.uniform(0.8, 1.2)
        if self._local_gpus is not None or self._check_failed:
            return self._interval_s * jitter
        delay = self._idle_interval_s * jitter
        try:
            first_ms = await self._manager.next_expiry_ms()
        except Exception as error:  # the step after it reports the trouble; the loop goes on
            log.debug("next lease expiry unknown: %s", error)
            return self._interval_s * jitter
        if first_ms is not None:  # just after it expires (reap frees a lease once expires_at < now)
            until_s = (first_ms - self._manager.now_ms()) / 1000.0 + _AFTER_EXPIRY_S
            # Already expired (time passed while planning): step at once, unless the last step
            # ran at once too and left it there. (Waiting _MIN_DELAY_S here stalled a test
            # whose FakeClock moved past the expiry while the plan was made, then stopped.)
            delay = min(delay, max(_MIN_DELAY_S if self._stepped_at_once else 0.0, until_s))
        return delay

    async def _outside(self, local: LocalGpus) -> dict[int, int]:
        """Memory used outside live leases per GPU of this host, from an NVML sample."""
        samples = await asyncio.to_thread(local.sampler.sample)
        leases = await self._manager.leases(node=local.node)
        return outside_per_gpu(
            samples,
            leases=leases,
            node=local.node,
            reserve_mb={s.index: local.reserve_mb for s in samples},
            now_ms=self._manager.now_ms(),
            horizon_ms=round(local.horizon_s * 1000),
            ancestors=proc_ancestors,
        )

    async def _reconcile(self, local: LocalGpus) -> None:
        await self._manager.set_outside(local.node, await self._outside(local))

    async def _guarded_step(self) -> None:
        started = self._clock.monotonic()
        try:
            await self.step()
        except LoadmasterError as error:
            log.warning("reaper step failed: %s", error.message)
        except Exception:
            log.exception("reaper step failed")
        elapsed = self._clock.monotonic() - started
        if elapsed > self._slow_step_s:
            log.warning("reaper step took %.2fs", elapsed)

    def _granted(self, expires_unix_ms: int) -> None:
        self._gauges_after_change()
        # While planning, any grant may have missed the read of the first expiry: plan again.
        if self._next_step_ms is None or expires_unix_ms < self._next_step_ms:
            self._replan.set()

    async def _run(self) -> None:
        while True:
            self._next_step_ms = None
            self._replan.clear()
            delay = await self._next_delay()
            self._next_step_ms = self._manager.now_ms() + round(delay * 1000)
            at_once = delay <= 0  # no grant can expire before it: no replanning either
            if at_once or await self._sleep_or_replan(delay):
                self._stepped_at_once = at_once
                await self._guarded_step()

    async def _sleep_until(self, wake_at: float) -> None:
        await self._clock.sleep(wake_at - self._clock.monotonic())

    async def _sleep_or_replan(self, delay_s: float) -> bool:
        """True when `delay_s` passed; False when a grant asked to plan again first."""
        if self._replan.is_set():
            return False
        # The end is fixed now: the sleeping task starts a loop turn later, and a clock that
        # moved meanwhile must not push the step back (a test's FakeClock.advance did).
        sleep = asyncio.ensure_future(self._sleep_until(self._clock.monotonic() + delay_s))
        replan = asyncio.ensure_future(self._replan.wait())
        try:
            await asyncio.wait((sleep, replan), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleep.cancel()
            replan.cancel()
        return not self._replan.is_set()
