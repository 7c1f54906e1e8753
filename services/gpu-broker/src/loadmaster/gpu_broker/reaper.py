"""The broker's background loop: register the local inventory (until it succeeds), reap
expired leases, and report per-GPU gauges. Every replica runs one; the reap script makes
concurrent reaping safe. A step that fails is logged and the loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Mapping, Sequence

from loadmaster.common.clock import Clock
from loadmaster.common.errors import LoadmasterError
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.gpu_broker.leases import GpuState
from loadmaster.gpu_broker.manager import LeaseManager

__all__ = ["Reaper"]

log = logging.getLogger(__name__)


class Reaper:
    def __init__(
        self,
        manager: LeaseManager,
        *,
        clock: Clock,
        inventory: Mapping[str, Sequence[GpuState]],
        telemetry: TelemetryReporter | None = None,
        interval_s: float = 1.0,
        slow_step_s: float = 0.5,
        rng: random.Random | None = None,
    ) -> None:
        self._manager = manager
        self._clock = clock
        self._unregistered = dict(inventory)
        self._telemetry = telemetry
        self._interval_s = interval_s
        self._slow_step_s = slow_step_s
        self._rng = rng or random.Random()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Run one step now (so the inventory is registered before serving), then loop."""
        await self._guarded_step()
        self._task = asyncio.create_task(self._run(), name="gpu-broker-reaper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def step(self) -> int:
        """Register what is still unregistered, reap, report gauges. Returns leases reaped."""
        for node, gpus in list(self._unregistered.items()):
            registered = await self._manager.register_node(node, gpus)
            del self._unregistered[node]
            log.info("registered node %s: %d GPU(s)", node, len(registered))
        reaped = await self._manager.reap()
        if reaped:
            log.info("reaped %d expired lease(s)", reaped)
        if self._telemetry is not None:
            for gpu in await self._manager.inventory():
                labels = {"node": gpu.node, "gpu": str(gpu.index)}
                self._telemetry.record("lease_mb", gpu.leased_mb, labels)
                self._telemetry.record("free_mb", gpu.free_mb, labels)
        return reaped

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

    async def _run(self) -> None:
        while True:
            await self._clock.sleep(self._interval_s * self._rng.uniform(0.8, 1.2))
            await self._guarded_step()
