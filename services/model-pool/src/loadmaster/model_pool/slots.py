"""Model slots: the lifecycle state of one model on this worker, as pure values.

    IDLE -> LOADING -> READY -> DRAINING -> UNLOADING -> IDLE
              |
              +-> IDLE (the load failed: `error` says why; nothing stays half-loaded)

A `Slot` is the mutable record the pool keeps per model; `SlotStatus` is the frozen
snapshot handed to the wire (Status, WorkerReport) and to listeners. The generation
goes up by one each time a load starts, so a reply names the load that produced it.
Slots hold no engine, thread or lease: the pool owns those (`pool.py`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import StrEnum

from loadmaster.common.clock import Clock
from loadmaster.common.errors import UnavailableError

__all__ = ["ModelState", "Slot", "SlotStatus", "TransitionError"]


class ModelState(StrEnum):
    """Mirrors `loadmaster.v1.ModelState` (without UNSPECIFIED)."""

    IDLE = "idle"
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    UNLOADING = "unloading"


_ALLOWED: dict[ModelState, frozenset[ModelState]] = {
    ModelState.IDLE: frozenset({ModelState.LOADING}),
    ModelState.LOADING: frozenset({ModelState.READY, ModelState.IDLE}),
    ModelState.READY: frozenset({ModelState.DRAINING}),
    ModelState.DRAINING: frozenset({ModelState.UNLOADING}),
    ModelState.UNLOADING: frozenset({ModelState.IDLE}),
}


class TransitionError(RuntimeError):
    """A lifecycle step out of order: a bug in the caller, never a client error."""


@dataclass(frozen=True, slots=True)
class SlotStatus:
    model_id: str
    state: ModelState
    generation: int
    inflight: int
    max_inflight: int
    device: str
    vram_mb: int
    backend: str
    pinned: bool
    priority: int
    last_used_unix_ms: int
    loaded_unix_ms: int
    load_time_ms: float
    error: str
    lease_id: str
    load_started_unix_ms: int = 0  # the load in progress began (LOADING only)
    instances: int = 1
    max_batch_size: int = 1
    evictions: int = 0
    reloads: int = 0
    mb_per_gpu: tuple[tuple[int, int], ...] = ()
    keep_alive_s: float | None = None  # idle seconds before unloading (None: never)


class Slot:
    """Lifecycle and accounting of one model. Not thread-safe: event-loop thread only."""

    def __init__(
        self,
        model_id: str,
        *,
        clock: Clock,
        max_inflight: int = 1,
        pinned: bool = False,
        priority: int = 1,
        backend: str = "",
    ) -> None:
        self.model_id = model_id
        self._clock = clock
        self.state = ModelState.IDLE
        self.generation = 0
        self.inflight = 0
        self.max_inflight = max_inflight
        self.pinned = pinned
        self.priority = priority
        self.backend = backend
        self.device = ""
        self.vram_mb = 0
        self.lease_id = ""
        self.error = ""
        self.last_used_unix_ms = 0
        self.loaded_unix_ms = 0
        self.load_time_ms = 0.0  # the last load's duration (kept while the next one runs)
        self.load_started_unix_ms = 0
        self.instances = 1
        self.max_batch_size = 1
        self.evictions = 0
        self.reloads = 0
        self.mb_per_gpu: tuple[tuple[int, int], ...] = ()
        # Monotonic twins of the wall-clock stamps above, for keep-alive and eviction order.
        self.last_used_monotonic = 0.0
        self.loaded_monotonic = 0.0
        self.keep_alive_s: float | None = None  # the deployment's, read at each load
        self._load_started = 0.0
        self._drained = asyncio.Event()
        self._drained.set()

    # ---- lifecycle ------------------------------------------------------

    def _move(self, target: ModelState) -> None:
        if target not in _ALLOWED[self.state]:
            raise TransitionError(f"model '{self.model_id}': {self.state.value} -> {target.value}")
        self.state = target

    def begin_load(self) -> int:
        """IDLE -> LOADING; returns the new generation."""
        self._move(ModelState.LOADING)
        self.generation += 1
        self.error = ""
        self.lease_id = ""
        self._load_started = self._clock.monotonic()
        self.load_started_unix_ms = int(self._clock.time() * 1000)
        return self.generation

    def set_placement(self, *, backend: str, device: str, vram_mb: int) -> None:
        self.backend = backend
        self.device = device
        self.vram_mb = vram_mb

    def set_lease(
        self, lease_id: str, *, device: str | None = None, mb_per_gpu: dict[int, int] | None = None
    ) -> None:
        self.lease_id = lease_id
        if device is not None:
            self.device = device
        if mb_per_gpu is not None:
            self.mb_per_gpu = tuple(sorted(mb_per_gpu.items()))

    def loaded(self) -> None:
        """LOADING -> READY."""
        self._move(ModelState.READY)
        now = self._clock.monotonic()
        self.load_time_ms = (now - self._load_started) * 1000.0
        self.loaded_unix_ms = int(self._clock.time() * 1000)
        self.loaded_monotonic = now
        self.last_used_monotonic = now
        self.error = ""

    def load_failed(self, error: str) -> None:
        """LOADING -> IDLE with `error`; the caller has already freed whatever was taken."""
        self._move(ModelState.IDLE)
        self.error = error
        self.lease_id = ""
        self.mb_per_gpu = ()

    def begin_drain(self, reason: str = "") -> None:
        """READY -> DRAINING: no new requests; `drained()` completes when in-flight ones finish."""
        self._move(ModelState.DRAINING)
        if reason:
            self.error = reason

    async def drained(self) -> None:
        await self._drained.wait()

    def begin_unload(self) -> None:
        """DRAINING -> UNLOADING (only once nothing is in flight)."""
        if self.inflight:
            raise TransitionError(f"model '{self.model_id}': unloading with {self.inflight} in flight")
        self._move(ModelState.UNLOADING)

    def unloaded(self) -> None:
        """UNLOADING -> IDLE."""
        self._move(ModelState.IDLE)
        self.lease_id = ""
        self.loaded_unix_ms = 0
        self.mb_per_gpu = ()

    # ---- requests -------------------------------------------------------

    def acquire(self) -> int:
        """Admit one request; returns the generation it runs against. Raises when not READY."""
        if self.state is not ModelState.READY:
            detail = f" (last error: {self.error})" if self.error else ""
            raise UnavailableError(f"model '{self.model_id}' is {self.state.value}, not ready{detail}")
        if not self.inflight:
            self._drained.clear()
        self.inflight += 1
        return self.generation

    def release(self) -> None:
        """One admitted request finished (its engine call is over, not just its caller)."""
        self.inflight = max(0, self.inflight - 1)
        self.last_used_unix_ms = int(self._clock.time() * 1000)
        self.last_used_monotonic = self._clock.monotonic()
        if self.inflight == 0:
            self._drained.set()

    # ---- snapshot -------------------------------------------------------

    def status(self) -> SlotStatus:
        return SlotStatus(
            model_id=self.model_id,
            state=self.state,
            generation=self.generation,
            inflight=self.inflight,
            max_inflight=self.max_inflight,
            device=self.device,
            vram_mb=self.vram_mb,
            backend=self.backend,
            pinned=self.pinned,
            priority=self.priority,
            last_used_unix_ms=self.last_used_unix_ms,
            loaded_unix_ms=self.loaded_unix_ms,
            load_time_ms=self.load_time_ms,
            load_started_unix_ms=self.load_started_unix_ms if self.state is ModelState.LOADING else 0,
            error=self.error,
            lease_id=self.lease_id,
            instances=self.instances,
            max_batch_size=self.max_batch_size,
            evictions=self.evictions,
            reloads=self.reloads,
            mb_per_gpu=self.mb_per_gpu,
            keep_alive_s=self.keep_alive_s,
        )
