"""The worker's core: model slots, their engines, executors and leases.

`ModelPool` decides; the front doors (gRPC servicer, ZMQ data port, worker session)
only translate into its calls:

    load(model_id)     lease -> engine.load() + warmup on the model's thread -> READY
    unload(model_id)   DRAINING (wait for in-flight) -> engine.unload() -> release lease -> IDLE
    infer(model_id, inputs, deadline_unix_ns=...) -> InferResult

Each loaded model has its own single-thread executor: a slow model never blocks
another model's requests, and requests to one model run one at a time, in arrival
order. Lifecycle operations on one model are serialised (a second `load` waits for
the first and shares its result) and run as tasks shielded from their callers, so
a cancelled RPC never leaves a model half-loaded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.config import ModelsSettings
from loadmaster.common.errors import (
    ExpiredError,
    InternalError,
    InvalidArgumentError,
    LoadmasterError,
    NotFoundError,
    UnavailableError,
)
from loadmaster.common.tensors import wire_dtype
from loadmaster.model_pool.engines import Engine, EngineContext, engine_class
from loadmaster.model_pool.leases import Lease, LeaseClient, LeaseKeeper
from loadmaster.model_pool.repository import ModelRepository, ModelSpec, check_inputs
from loadmaster.model_pool.slots import ModelState, Slot, SlotStatus

__all__ = ["InferResult", "MetricsSink", "ModelPool", "device_for_lease", "gpus_for_device"]

log = logging.getLogger(__name__)


class MetricsSink(Protocol):
    def record(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None: ...


@dataclass(frozen=True, slots=True)
class InferResult:
    outputs: dict[str, np.ndarray]
    generation: int
    inference_ms: float
    queue_ms: float
    batch_size: int = 1


@dataclass(slots=True)
class _Loaded:
    """What a READY model holds: freed, in this order, by unload."""

    spec: ModelSpec
    engine: Engine
    executor: ThreadPoolExecutor
    lease: Lease


@dataclass(frozen=True, slots=True)
class _Operation:
    kind: Literal["load", "unload"]
    task: asyncio.Task[None]


def gpus_for_device(device: str) -> list[int]:
    """The GPUs to ask the broker for: `cuda:N` -> [N]; `cuda` / `cpu` -> any."""
    kind, _, index = device.partition(":")
    return [int(index)] if kind == "cuda" and index else []


def device_for_lease(device: str, lease: Lease) -> str:
    """`cuda` (any GPU) becomes the GPU the broker granted; explicit devices stay as they are."""
    if device == "cuda":
        return f"cuda:{lease.gpus[0]}" if lease.gpus else "cuda:0"
    return device


def _load_and_warm(engine: Engine) -> None:
    engine.load()
    engine.warmup()


async def _settle(task: asyncio.Future[Any]) -> None:
    """Wait for `task` without taking on its result or its error."""
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():
            raise
    except Exception:
        pass


class ModelPool:
    def __init__(
        self,
        repository: ModelRepository,
        *,
        models: ModelsSettings,
        lease_client: LeaseClient,
        device: str = "cpu",
        threads: int = 1,
        lease_ttl_s: float = 15.0,
        clock: Clock | None = None,
        metrics: MetricsSink | None = None,
        engines: Callable[[str], type[Engine]] = engine_class,
    ) -> None:
        self.repository = repository
        self._models = models
        self._lease_client = lease_client
        self._device = device
        self._threads = threads
        self._lease_ttl_s = lease_ttl_s
        self._clock = clock or SystemClock()
        self._metrics = metrics
        self._engines = engines
        self._keeper = LeaseKeeper(
            lease_client, ttl_s=lease_ttl_s, on_lost=self._on_lease_lost, clock=self._clock
        )
        self._slots: dict[str, Slot] = {}
        self._loaded: dict[str, _Loaded] = {}
        self._ops: dict[str, _Operation] = {}
        self._listeners: list[Callable[[SlotStatus], None]] = []
        self._reported_state: dict[str, ModelState] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._closing = False
        for model_id in repository.names():
            self._slot(model_id)

    # ---- queries ----------------------------------------------------------

    @property
    def closing(self) -> bool:
        return self._closing

    def statuses(self) -> list[SlotStatus]:
        return [self._slots[model_id].status() for model_id in sorted(self._slots)]

    def status(self, model_id: str) -> SlotStatus:
        return self._slot(model_id).status()

    def add_listener(self, listener: Callable[[SlotStatus], None]) -> None:
        """Called (on the event loop) with the new status each time a slot changes state."""
        self._listeners.append(listener)

    def _slot(self, model_id: str) -> Slot:
        slot = self._slots.get(model_id)
        if slot is not None:
            return slot
        if not self.repository.contains(model_id):
            raise NotFoundError(f"model '{model_id}' is not in the repository at {self.repository.root}")
        model = self._models.for_model(model_id)
        slot = Slot(
            model_id,
            clock=self._clock,
            max_inflight=model.max_inflight,
            pinned=model.pin,
            priority=model.priority,
        )
        self._slots[model_id] = slot
        return slot

    def _changed(self, slot: Slot) -> None:
        status = slot.status()
        previous = self._reported_state.get(slot.model_id)
        self._reported_state[slot.model_id] = status.state
        if self._metrics is not None:
            labels = {"model": slot.model_id}
            if previous is not None and previous is not status.state:
                self._metrics.record("slot_state", 0.0, {**labels, "state": previous.value})
            self._metrics.record("slot_state", 1.0, {**labels, "state": status.state.value})
        for listener in list(self._listeners):
            try:
                listener(status)
            except Exception:
                log.exception("slot listener failed")

    # ---- lifecycle ---------------------------------------------------------

    def _start(self, model_id: str, kind: Literal["load", "unload"], work: Coroutine[Any, Any, None]) -> _Operation:
        task = asyncio.create_task(work, name=f"{kind}-{model_id}")
        operation = _Operation(kind, task)
        self._ops[model_id] = operation

        def done(finished: asyncio.Task[None]) -> None:
            if self._ops.get(model_id) is operation:
                del self._ops[model_id]
            if not finished.cancelled():
                finished.exception()  # retrieved here; callers re-raise it themselves

        task.add_done_callback(done)
        return operation

    async def load(self, model_id: str) -> SlotStatus:
        """Load `model_id` (idempotent). Raises the load's error; the slot is then IDLE with it."""
        slot = self._slot(model_id)
        while (operation := self._ops.get(model_id)) is not None:
            if operation.kind == "load":
                await asyncio.shield(operation.task)
                return slot.status()
            await _settle(operation.task)
        if slot.state is ModelState.READY:
            return slot.status()
        if self._closing:
            raise UnavailableError("worker is shutting down")
        operation = self._start(model_id, "load", self._do_load(slot))
        await asyncio.shield(operation.task)
        return slot.status()

    async def unload(self, model_id: str, *, reason: str = "") -> SlotStatus:
        """Drain and unload `model_id` (idempotent); a load in progress finishes first."""
        slot = self._slot(model_id)
        while (operation := self._ops.get(model_id)) is not None:
            if operation.kind == "unload":
                await _settle(operation.task)
                return slot.status()
            await _settle(operation.task)
        if slot.state is not ModelState.READY:
            return slot.status()
        operation = self._start(model_id, "unload", self._do_unload(slot, reason))
        await _settle(operation.task)
        return slot.status()

    async def _do_load(self, slot: Slot) -> None:
        model_id = slot.model_id
        loop = asyncio.get_running_loop()
        slot.begin_load()
        self._changed(slot)
        lease: Lease | None = None
        executor: ThreadPoolExecutor | None = None
        engine: Engine | None = None
        try:
            spec = self.repository.spec(model_id)
            # The first use of a backend imports it (torch: seconds): off the event loop.
            cls = await asyncio.to_thread(self._engines, spec.backend)
            device = spec.config.device or self._device
            mb = self._models.for_model(model_id).vram_mb
            if mb is None:
                mb = spec.config.vram_mb if spec.config.vram_mb is not None else cls.estimate_mb(spec)
            mb = max(1, mb)  # the broker leases whole, positive megabytes
            slot.set_placement(backend=spec.backend, device=device, vram_mb=mb)
            lease = await self._lease_client.acquire(
                mb=mb, ttl_s=self._lease_ttl_s, labels={"model": model_id}, gpus=gpus_for_device(device)
            )
            device = device_for_lease(device, lease)
            slot.set_lease(lease.lease_id, device=device)
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"model-{model_id}")
            engine = cls(spec, EngineContext(device=device, threads=self._threads))
            await loop.run_in_executor(executor, _load_and_warm, engine)
        except BaseException as error:
            message = await self._abandon_load(model_id, error, engine=engine, executor=executor, lease=lease)
            slot.load_failed(message)
            self._changed(slot)
            if isinstance(error, LoadmasterError | asyncio.CancelledError):
                raise
            raise InternalError(message) from error
        self._loaded[model_id] = _Loaded(spec=spec, engine=engine, executor=executor, lease=lease)
        self._keeper.keep(model_id, lease)
        slot.loaded()
        self._changed(slot)
        if self._metrics is not None:
            self._metrics.record("model_load_ms", slot.load_time_ms, {"model": model_id})
        log.info("model %s ready on %s (generation %d, %.0f ms)", model_id, device, slot.generation, slot.load_time_ms)

    async def _abandon_load(
        self,
        model_id: str,
        error: BaseException,
        *,
        engine: Engine | None,
        executor: ThreadPoolExecutor | None,
        lease: Lease | None,
    ) -> str:
        """Free what a failed load took (engine, thread, lease); returns the error text."""
        if isinstance(error, LoadmasterError):
            message = error.message
            log.error("loading model %s failed: %s", model_id, message)
        else:
            message = f"loading model '{model_id}' failed: {type(error).__name__}: {error}"
            log.error("loading model %s failed", model_id, exc_info=error)
        if executor is not None:
            if engine is not None:
                try:
                    # Queued behind a load still running on that thread, so it frees what it built.
                    await asyncio.wrap_future(executor.submit(engine.unload))
                except Exception:
                    log.exception("cleaning up after the failed load of %s", model_id)
            executor.shutdown(wait=False)
        if lease is not None:
            await self._release(model_id, lease)
        return message

    async def _release(self, model_id: str, lease: Lease) -> None:
        try:
            await self._lease_client.release(lease)
        except Exception as error:
            log.warning("releasing lease %s of %s failed (it expires by TTL): %s", lease.lease_id, model_id, error)

    async def _do_unload(self, slot: Slot, reason: str) -> None:
        model_id = slot.model_id
        slot.begin_drain(reason)
        self._changed(slot)
        await slot.drained()
        slot.begin_unload()
        self._changed(slot)
        loaded = self._loaded.pop(model_id)
        lease = self._keeper.forget(model_id) or loaded.lease
        try:
            await asyncio.wrap_future(loaded.executor.submit(loaded.engine.unload))
        except Exception:
            log.exception("unloading model %s failed", model_id)
        finally:
            loaded.executor.shutdown(wait=False)
        await self._release(model_id, lease)  # only after the engine freed its memory
        slot.unloaded()
        self._changed(slot)
        log.info("model %s unloaded%s", model_id, f" ({reason})" if reason else "")

    def _on_lease_lost(self, model_id: str, lease: Lease) -> None:
        loaded = self._loaded.get(model_id)
        if loaded is None or loaded.lease.lease_id != lease.lease_id:
            return
        task = asyncio.create_task(
            self.unload(model_id, reason=f"lease {lease.lease_id} lost; stopped serving"),
            name=f"lease-lost-{model_id}",
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self, *, timeout_s: float = 30.0) -> None:
        """Refuse new work, drain and unload every model, release every lease."""
        self._closing = True
        busy = [
            model_id
            for model_id, slot in self._slots.items()
            if slot.state is not ModelState.IDLE or model_id in self._ops
        ]
        unloads = asyncio.gather(
            *(self.unload(model_id, reason="worker shutting down") for model_id in busy),
            return_exceptions=True,
        )
        try:
            await asyncio.wait_for(unloads, timeout_s)
        except TimeoutError:
            log.error("models still busy after %.1fs at shutdown; releasing their leases", timeout_s)
            for model_id, loaded in list(self._loaded.items()):
                await self._release(model_id, self._keeper.forget(model_id) or loaded.lease)
        await self._keeper.close()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    # ---- inference ---------------------------------------------------------

    async def infer(
        self,
        model_id: str,
        inputs: Mapping[str, np.ndarray],
        *,
        deadline_unix_ns: int = 0,
        received_monotonic: float | None = None,
    ) -> InferResult:
        """Run one request on the model's thread. Errors are `LoadmasterError`s (engine bugs: internal)."""
        if self._closing:
            raise UnavailableError("worker is shutting down")
        slot = self._slot(model_id)
        generation = slot.acquire()
        loaded = self._loaded[model_id]
        try:
            check_inputs(loaded.spec, inputs)
            if deadline_unix_ns and self._clock.time() * 1e9 >= deadline_unix_ns:
                raise ExpiredError(f"request for '{model_id}' expired before it started")
        except BaseException:
            slot.release()
            raise
        received = self._clock.monotonic() if received_monotonic is None else received_monotonic
        loop = asyncio.get_running_loop()
        future = loaded.executor.submit(self._run, loaded, inputs, deadline_unix_ns, received)
        future.add_done_callback(lambda _: _call_soon(loop, slot.release))
        try:
            outputs, queue_ms, inference_ms = await asyncio.wrap_future(future)
        except LoadmasterError:
            raise
        except Exception as error:
            log.error("model %s failed on a request", model_id, exc_info=error)
            raise InternalError(f"model '{model_id}' failed: {type(error).__name__}: {error}") from error
        if self._metrics is not None:
            labels = {"model": model_id}
            self._metrics.record("inference_latency_ms", inference_ms, labels)
            self._metrics.record("batch_size", 1.0, labels)
        return InferResult(outputs=outputs, generation=generation, inference_ms=inference_ms, queue_ms=queue_ms)

    def _run(
        self, loaded: _Loaded, inputs: Mapping[str, np.ndarray], deadline_unix_ns: int, received: float
    ) -> tuple[dict[str, np.ndarray], float, float]:
        """On the model's thread: never start after the deadline; check outputs can travel."""
        started = self._clock.monotonic()
        queue_ms = (started - received) * 1000.0
        if deadline_unix_ns and self._clock.time() * 1e9 >= deadline_unix_ns:
            raise ExpiredError(
                f"request for '{loaded.spec.model_id}' expired after {queue_ms:.1f} ms in the model's queue"
            )
        outputs = loaded.engine.infer(inputs)
        inference_ms = (self._clock.monotonic() - started) * 1000.0
        for key, array in outputs.items():
            try:
                wire_dtype(array.dtype)
            except InvalidArgumentError:
                raise InternalError(
                    f"model '{loaded.spec.model_id}' output '{key}' has dtype {array.dtype}, "
                    "which cannot travel on the wire"
                ) from None
        return outputs, queue_ms, inference_ms


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:  # the loop closed during shutdown
        pass
