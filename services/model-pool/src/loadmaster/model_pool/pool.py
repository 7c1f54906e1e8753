"""The worker's core: model slots, their engines, executors and leases.

`ModelPool` decides; the front doors (gRPC servicer, ZMQ data port, worker session)
only translate into its calls:

    load(model_id)     lease (evicting idle models when it does not fit) -> engine.load()
                       + warm-up on each instance's thread -> READY
    unload(model_id)   DRAINING (wait for in-flight) -> engine.unload() -> memory freed
                       -> release lease -> IDLE
    infer(model_id, inputs, deadline_unix_ns=...) -> InferResult   (through the model's Batcher)
    submit(model_id, inputs, done=callback, ...)   the same, answered by a callback (data port)
    pin(model_id, pinned)   never evicted while pinned

Each loaded model has `instances` engine copies, each on its own single-thread
executor, fed by one `Batcher` (dynamic batching when `max_batch_size` > 1): a slow
model never blocks another model's requests. Lifecycle operations on one model are
serialised (a second `load` waits for the first and shares its result) and run as
tasks shielded from their callers, so a cancelled RPC never leaves a model half-loaded.
Which model to evict is decided in `eviction.py` and how to make room in `room.py`; this
module only acts on them. It also admits requests and generation streams (`submit`, `infer`,
`open_generation`), releases leases, and unloads a model whose lease was lost or whose engine
failed (a replaced lease is recorded in place).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Coroutine, Mapping
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
    ResourceExhaustedError,
    UnavailableError,
)
from loadmaster.model_pool import memory
from loadmaster.model_pool._waiting import settle
from loadmaster.model_pool.batcher import Batcher, BatchOutcome, Instance, batch_policy
from loadmaster.model_pool.crash_backoff import CrashBackoff
from loadmaster.model_pool.engines import Engine, EngineContext, engine_class
from loadmaster.model_pool.eviction import EvictionCounters, Resident
from loadmaster.model_pool.generation_order import OrderPolicy
from loadmaster.model_pool.instances import free_instances, load_instance
from loadmaster.model_pool.keep_alive import KeepAlive, keep_alive_for
from loadmaster.model_pool.leases import (
    Lease,
    LeaseClient,
    WorkerLeases,
    device_for_lease,
    gpus_for_device,
)
from loadmaster.model_pool.repository import ModelRepository, ModelSpec, check_inputs
from loadmaster.model_pool.room import Room, may_fit_later
from loadmaster.model_pool.slots import ModelState, Slot, SlotStatus

__all__ = [
    "GenerationAdmission",
    "InferResult",
    "MetricsSink",
    "ModelPool",
    "device_for_lease",
    "gpus_for_device",
]

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
    batch_id: int = 0  # requests of one model generation with the same batch_id ran in one engine call


@dataclass(frozen=True, slots=True)
class GenerationAdmission:
    """One generation stream admitted on a generative model: `engine` runs it, `sequences`
    is how many the engine runs at once, and `release()` (once, at the stream's terminal)
    gives the admission back. Held for the stream's whole life, so `max_inflight`,
    keep-alive and eviction count it and never unload the model mid-stream."""

    engine: Any
    generation: int
    sequences: int
    release: Callable[[], None]


@dataclass(slots=True)
class _Loaded:
    """What a READY model holds: freed, in this order, by unload."""

    spec: ModelSpec
    instances: list[Instance]
    batcher: Batcher
    lease: Lease | None  # None: the model holds no GPU memory (a hosted API)
    memory_before: dict[int, int]  # NVML: this process's MB per leased GPU before the load


def _resolve(future: asyncio.Future[InferResult], outcome: InferResult | BaseException) -> None:
    if future.done():  # the caller was cancelled
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


@dataclass(frozen=True, slots=True)
class _Operation:
    kind: Literal["load", "unload"]
    task: asyncio.Task[None]


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
        eviction_wait_s: float = 10.0,
        allow_split: bool = True,
        renewal_client: Callable[[], LeaseClient] | None = None,
        load_retry_s: tuple[float, float] = (0.5, 30.0),
        warm_bump_s: tuple[float, float] = (0.0, 0.0),
        order_policy: OrderPolicy | None = None,
    ) -> None:
        """`renewal_client` makes the client the lease keeper's thread renews with (a gRPC
        client binds to one event loop: give it its own); default: `lease_client` itself.
        `load_retry_s`: (first, most) seconds a failed load of a model waits before the next
        attempt, doubling in between (not after a refusal for memory: the scheduler's VRAM gate
        paces those). `warm_bump_s`: (bound, idle) of the warm bump (room.py). `order_policy`:
        how generative engines order their generations (generation_order.py)."""
        self.repository = repository
        self._models = models
        self._lease_client = lease_client
        self._device = device
        self._threads = threads
        self._order_policy = order_policy or OrderPolicy()
        self._lease_ttl_s = lease_ttl_s
        self._clock = clock or SystemClock()
        self._metrics = metrics
        self._engines = engines
        self.counters = EvictionCounters()
        self._room = Room(
            lease_client,
            residents=functools.partial(self._residents, settling=True, holding=True),
            evict=lambda victim, incoming: self._evict(
                victim, reason="capacity", detail=f"room for {incoming}"
            ),
            clock=self._clock,
            ttl_s=lease_ttl_s,
            wait_s=eviction_wait_s,
            allow_split=allow_split,
            bump_s=warm_bump_s[0],
            bump_idle_s=warm_bump_s[1],
        )
        self._keep_alive = KeepAlive(
            residents=self._residents,
            unload_idle=lambda model_id: self._evict(model_id, reason="idle"),
            clock=self._clock,
        )
        self._reported_gpus: set[int] = set()
        self._keeper = WorkerLeases(
            renewal_client or (lambda: lease_client),
            ttl_s=lease_ttl_s,
            on_lost=self._on_lease_lost,
            on_replaced=self._on_lease_replaced,
            owns_client=renewal_client is not None,
        )
        self._load_retry_s = load_retry_s
        self._load_backoff: dict[str, tuple[float, float]] = {}  # model -> (next attempt at, delay)
        self.crash_backoff = CrashBackoff(first_s=load_retry_s[0], max_s=load_retry_s[1])
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
    def order_policy(self) -> OrderPolicy:
        """How generations are ordered (`generation:` settings; generation_order.py)."""
        return self._order_policy

    @property
    def closing(self) -> bool:
        return self._closing

    def generative_engine(self, model_id: str) -> Any:
        """The loaded engine of a generative model that orders its own generations, else None."""
        loaded = self._loaded.get(model_id)
        if loaded is None or not loaded.instances:
            return None
        engine = loaded.instances[0].engine
        return engine if getattr(engine, "orders_generations", False) else None

    def statuses(self) -> list[SlotStatus]:
        return [self._slots[model_id].status() for model_id in sorted(self._slots)]

    def status(self, model_id: str) -> SlotStatus:
        return self._slot(model_id).status()

    def free_mb(self) -> int:
        """Memory this worker could free now: READY models that are neither pinned nor busy."""
        return sum(r.vram_mb for r in self._residents() if not r.pinned and r.inflight == 0)

    def leased_mb_per_gpu(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for loaded in self._loaded.values():
            for gpu, mb in (loaded.lease.mb_per_gpu if loaded.lease else {}).items():
                out[gpu] = out.get(gpu, 0) + mb
        return out

    def pin(self, model_id: str, *, pinned: bool = True) -> SlotStatus:
        """Pin (never evicted, never unloaded when idle) or unpin a model; loaded or not."""
        slot = self._slot(model_id)
        slot.pinned = pinned
        self._changed(slot)
        self._keep_alive.poke()
        return slot.status()

    def use_models(self, models: ModelsSettings) -> None:
        """Deployment settings changed at run time (docs/admin.md): a model whose configured
        `pin` changed is pinned or unpinned now (a pin set through `pin()` stays until its
        setting changes); a loaded model's keep-alive is read again; the rest apply at the
        next load."""
        previous, self._models = self._models, models
        for model_id, slot in self._slots.items():
            pinned = models.for_model(model_id).pin
            if pinned != previous.for_model(model_id).pin:
                slot.pinned = pinned
                self._changed(slot)
            loaded = self._loaded.get(model_id)
            if loaded is not None:
                slot.keep_alive_s = keep_alive_for(models, loaded.spec)
                if slot.keep_alive_s is not None and not self._closing:
                    self._keep_alive.start()
        self._keep_alive.poke()

    def set_keep_alive(self, model_id: str, keep_alive_s: float) -> None:
        """A request's keep-alive for a loaded model (Ollama's `keep_alive`): its idle seconds
        from now until its next load (0: unload once idle; < 0: never for idleness)."""
        slot = self._slot(model_id)
        slot.keep_alive_s = None if keep_alive_s < 0 else keep_alive_s
        if slot.keep_alive_s is not None and not self._closing:
            self._keep_alive.start()
        self._keep_alive.poke()

    def _residents(self, *, settling: bool = False, holding: bool = False) -> list[Resident]:
        """READY models; with `settling`, also those holding a lease on the way in or out; with
        `holding`, only those that hold memory (a remote model frees none by going)."""
        out = []
        for model_id, slot in self._slots.items():
            if holding and slot.vram_mb <= 0:
                continue
            if slot.state is ModelState.READY:
                state = "ready"
            elif settling and slot.lease_id and slot.state is not ModelState.IDLE:
                state = "loading" if slot.state is ModelState.LOADING else "unloading"
            else:
                continue
            model = self._models.for_model(model_id)
            out.append(
                Resident(
                    model_id=model_id,
                    vram_mb=slot.vram_mb,
                    priority=slot.priority,
                    pinned=slot.pinned,
                    inflight=slot.inflight,
                    last_used=slot.last_used_monotonic,
                    loaded_at=slot.loaded_monotonic,
                    gpus=tuple(gpu for gpu, _ in slot.mb_per_gpu),
                    mb_per_gpu=tuple(slot.mb_per_gpu),
                    min_resident_s=model.min_resident_s,
                    keep_alive_s=slot.keep_alive_s,
                    state=state,
                )
            )
        return out

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
        try:  # known before the first load, so front ends can tell generative models apart
            backend = self.repository.spec(model_id).backend
        except Exception:
            backend = ""  # a bad config fails its load, with the reason
        slot = Slot(
            model_id,
            clock=self._clock,
            max_inflight=model.max_inflight,
            pinned=model.pin,
            priority=model.priority,
            backend=backend,
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

    # ---- admission: requests and generation streams on READY models ---------

    def submit(
        self,
        model_id: str,
        inputs: Mapping[str, np.ndarray],
        *,
        done: Callable[[InferResult | BaseException], None],
        deadline_unix_ns: int = 0,
        received_monotonic: float | None = None,
        front: bool = False,
    ) -> None:
        """Admit one request and queue it on the model's batcher (`front`: ahead of the requests
        waiting there: a call the gateway sent ahead of those it staged); `done` is called once, on the
        event loop, with its `InferResult` or its error. Refusals at the door (closing, unknown or
        not READY model, bad inputs, deadline passed) raise `LoadmasterError` instead. The request
        stays in flight until its engine call is over, whoever still waits. A callback, so the
        data port answers a whole batch in one loop wake-up; `infer` is the awaitable form."""
        if self._closing:
            raise UnavailableError("worker is shutting down")
        slot = self._slot(model_id)
        generation = slot.acquire()
        try:
            loaded = self._loaded[model_id]
            if loaded.lease is not None and not self._keeper.live(model_id):
                raise UnavailableError(f"model '{model_id}' has no live GPU lease; not serving it")
            check_inputs(loaded.spec, inputs)
            if deadline_unix_ns and self._clock.time() * 1e9 >= deadline_unix_ns:
                raise ExpiredError(f"request for '{model_id}' expired before it started")
            received = self._clock.monotonic() if received_monotonic is None else received_monotonic

            def finished(outcome: BatchOutcome) -> None:
                self._released(slot)
                if isinstance(outcome, BaseException):
                    done(outcome)
                    return
                outputs, timing = outcome
                done(
                    InferResult(
                        outputs,
                        generation,
                        timing.inference_ms,
                        timing.queue_ms,
                        timing.batch_size,
                        timing.batch_id,
                    )
                )

            loaded.batcher.submit(
                inputs, deadline_unix_ns=deadline_unix_ns, received=received, done=finished, front=front
            )
        except BaseException:
            self._released(slot)
            raise

    def image_inputs(self, model_id: str) -> tuple[dict[str, tuple[int, ...] | None], str]:
        """The READY model's inputs declared `image: true` (name -> declared shape) and its
        device, for decoding compressed images sent as BYTES; ({}, "cpu") when it has none."""
        loaded = self._loaded.get(model_id)
        if loaded is None:
            return {}, "cpu"
        declared = {spec.name: spec.shape for spec in loaded.spec.config.inputs if spec.image}
        return declared, loaded.instances[0].engine.context.device if declared else "cpu"

    def image_device(self, model_id: str) -> str:
        """The device of the READY model (where its JPEG tensors may decode); "cpu" when unknown."""
        loaded = self._loaded.get(model_id)
        return loaded.instances[0].engine.context.device if loaded is not None else "cpu"

    async def infer(
        self,
        model_id: str,
        inputs: Mapping[str, np.ndarray],
        *,
        deadline_unix_ns: int = 0,
        received_monotonic: float | None = None,
    ) -> InferResult:
        """Run one request (batched with others when the model batches). Errors are `LoadmasterError`s.
        A cancelled caller stops waiting; the request itself runs on (see `submit`)."""
        future: asyncio.Future[InferResult] = asyncio.get_running_loop().create_future()
        done = functools.partial(_resolve, future)
        self.submit(
            model_id,
            inputs,
            done=done,
            deadline_unix_ns=deadline_unix_ns,
            received_monotonic=received_monotonic,
        )
        return await future

    def open_generation(self, model_id: str, *, deadline_unix_ns: int = 0) -> GenerationAdmission:
        """Admit one generation stream of a generative model (docs/generative.md). Refusals raise
        `LoadmasterError`: closing, unknown or not READY model, no live lease, a model that is
        not generative, a deadline already passed."""
        if self._closing:
            raise UnavailableError("worker is shutting down")
        slot = self._slot(model_id)
        generation = slot.acquire()
        try:
            loaded = self._loaded[model_id]
            if loaded.lease is not None and not self._keeper.live(model_id):
                raise UnavailableError(f"model '{model_id}' has no live GPU lease; not serving it")
            engine = loaded.instances[0].engine
            if not callable(getattr(engine, "submit", None)):
                raise InvalidArgumentError(
                    f"model '{model_id}' is not generative (backend {loaded.spec.backend}): send it tensors"
                )
            if deadline_unix_ns and self._clock.time() * 1e9 >= deadline_unix_ns:
                raise ExpiredError(f"generation for '{model_id}' expired before it started")
        except BaseException:
            self._released(slot)
            raise
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._released(slot)

        sequences = int(getattr(loaded.spec.config, "max_sequences", 1) or 1)
        return GenerationAdmission(engine, generation, sequences, release)

    def _released(self, slot: Slot) -> None:
        slot.release()
        if slot.inflight == 0:
            self._room.changed()
            if slot.keep_alive_s is not None:  # its idle clock starts now
                self._keep_alive.poke()

    # ---- lifecycle ---------------------------------------------------------

    def _start(
        self, model_id: str, kind: Literal["load", "unload"], work: Coroutine[Any, Any, None]
    ) -> _Operation:
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
            await settle(operation.task)
        if slot.state is ModelState.READY:
            return slot.status()
        if self._closing:
            raise UnavailableError("worker is shutting down")
        backoff = self._load_backoff.get(model_id)
        if backoff is not None and self._clock.monotonic() < backoff[0]:
            raise UnavailableError(
                f"loading model '{model_id}' failed ({slot.error}); "
                f"next attempt in {backoff[0] - self._clock.monotonic():.1f}s"
            )
        operation = self._start(model_id, "load", self._do_load(slot))
        try:
            await asyncio.shield(operation.task)
        except LoadmasterError as error:
            if isinstance(error, ResourceExhaustedError) and may_fit_later(error):
                raise  # no memory now: trying again costs little (the VRAM gate paces it)
            delay = self._load_retry_s[0] if backoff is None else min(backoff[1] * 2, self._load_retry_s[1])
            self._load_backoff[model_id] = (self._clock.monotonic() + delay, delay)
            raise
        self._load_backoff.pop(model_id, None)
        return slot.status()

    async def unload(self, model_id: str, *, reason: str = "") -> SlotStatus:
        """Drain and unload `model_id` (idempotent); a load in progress finishes first."""
        slot = self._slot(model_id)
        while (operation := self._ops.get(model_id)) is not None:
            if operation.kind == "unload":
                await settle(operation.task)
                return slot.status()
            await settle(operation.task)
        if slot.state is not ModelState.READY:
            return slot.status()
        operation = self._start(model_id, "unload", self._do_unload(slot, reason))
        await settle(operation.task)
        return slot.status()

    async def _do_load(self, slot: Slot) -> None:
        model_id = slot.model_id
        slot.begin_load()
        self._changed(slot)
        lease: Lease | None = None
        built: list[Instance] = []
        memory_before: dict[int, int] = {}
        try:
            spec = self.repository.spec(model_id)
            # The first use of a backend imports it (torch: seconds): off the event loop.
            cls = await asyncio.to_thread(self._engines, spec.backend)
            model = self._models.for_model(model_id)
            policy = batch_policy(spec.config, model)
            sequences = int(getattr(spec.config, "max_sequences", 0) or 0)
            if getattr(cls, "orders_generations", False) and model.max_inflight <= sequences:
                log.warning(
                    "model '%s': max_inflight %d is not above its %d sequences: streams beyond them "
                    "wait in the scheduler, where urgent ones cannot take a lower-priority place "
                    "(docs/generation-scheduling.md)",
                    model_id,
                    model.max_inflight,
                    sequences,
                )
            count = model.instances or spec.config.instances
            device = spec.config.device or self._device
            mb = model.vram_mb
            if mb is None:
                mb = spec.config.vram_mb if spec.config.vram_mb is not None else cls.estimate_mb(spec) * count
            mb = max(1, mb)  # the broker leases whole, positive megabytes
            if not cls.leases_memory:  # a hosted API: no lease, no device of ours
                device, mb = "remote", 0
            slot.set_placement(backend=spec.backend, device=device, vram_mb=mb)
            slot.instances, slot.max_batch_size = count, policy.max_batch_size
            slot.keep_alive_s = keep_alive_for(self._models, spec)
            if cls.leases_memory:
                lease = await self._room.acquire(model_id, slot.priority, mb=mb, device=device)
                self._keeper.keep(model_id, lease)  # renewed from now on, also while loading
                device = device_for_lease(device, lease)
                slot.set_lease(lease.lease_id, device=device, mb_per_gpu=dict(lease.mb_per_gpu))
                if device.startswith("cuda"):
                    memory_before = await asyncio.to_thread(memory.snapshot, lease.gpus)
            context = EngineContext(
                device=device,
                threads=self._threads,
                gpus=tuple(lease.gpus) if lease is not None else (),
                on_failure=self._failure_reporter(model_id, slot.generation),
                order_policy=self._order_policy,
            )
            for index in range(count):  # each loaded and warmed up on its own thread before READY
                await load_instance(built, cls, spec, context, name=f"model-{model_id}-{index}")
            if lease is not None:
                if self._keeper.lease(model_id) is None:
                    raise UnavailableError(f"the GPU lease of model '{model_id}' was lost while it loaded")
                lease = self._keeper.lease(model_id) or lease  # a re-established one has a new id
        except BaseException as error:
            message = await self._abandon_load(model_id, error, instances=built, lease=lease)
            slot.load_failed(message)
            self._changed(slot)
            self._room.changed()
            if isinstance(error, LoadmasterError | asyncio.CancelledError):
                raise
            raise InternalError(message) from error
        batcher = Batcher(
            model_id,
            policy,
            instances=built,
            clock=self._clock,
            on_batch=lambda size, ms: self._record_batch(model_id, size, ms),
            usable=functools.partial(self._keeper.live, model_id) if lease is not None else _always,
        )
        batcher.start()
        self._loaded[model_id] = _Loaded(
            spec=spec, instances=built, batcher=batcher, lease=lease, memory_before=memory_before
        )
        slot.loaded()
        self._room.changed()  # a load waiting for this one may now evict it (once of age)
        if self.counters.loaded(model_id):
            slot.reloads += 1
            self._record("reloads", 1.0, {"model": model_id})
        self._changed(slot)
        self._record("model_load_ms", slot.load_time_ms, {"model": model_id})
        self._record_leased()
        if slot.keep_alive_s is not None and not self._closing:
            self._keep_alive.start()
        log.info(
            "model %s ready on %s (generation %d, %d instance(s), batch <= %d, %.0f ms)",
            model_id,
            device,
            slot.generation,
            count,
            policy.max_batch_size,
            slot.load_time_ms,
        )

    def _failure_reporter(self, model_id: str, generation: int) -> Callable[[str], None]:
        """An engine's `on_failure`, callable from any thread: back on the loop, the crash is
        counted (repeated ones delay the next load) and the model unloaded."""
        loop = asyncio.get_running_loop()

        def crashed(reason: str) -> None:
            slot = self._slots.get(model_id)
            if slot is None or slot.state is not ModelState.READY or slot.generation != generation:
                return  # a failed load says so itself; a report about an earlier load is stale
            now = self._clock.monotonic()
            delay = self.crash_backoff.crashed(model_id, now=now)
            if delay > 0:
                self._load_backoff[model_id] = (now + delay, delay)
                count = self.crash_backoff.crashes(model_id, now=now)
                reason = f"{reason}; {count} crashes, next load in {delay:.1f}s"
            self.engine_failed(model_id, generation, reason)

        def report(reason: str) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the worker is gone
                loop.call_soon_threadsafe(crashed, reason)

        return report

    # ---- eviction ------------------------------------------------------------

    async def _evict(self, model_id: str, *, reason: str, detail: str = "") -> None:
        slot = self._slots[model_id]
        log.info("evicting model %s (%s%s)", model_id, reason, f": {detail}" if detail else "")
        self.counters.evicted(model_id, reason)
        slot.evictions += 1
        self._record("evictions", 1.0, {"model": model_id, "reason": reason})
        await self.unload(model_id, reason=f"evicted ({reason}{': ' + detail if detail else ''})")

    # ---- teardown ----------------------------------------------------------

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
            await loaded.batcher.close()
            await free_instances(model_id, loaded.instances)
            await self._memory_freed(model_id, loaded)
        finally:
            if lease is not None:
                await self._release(model_id, lease)  # only after the engines freed their memory
            slot.unloaded()
            self._changed(slot)
            self._record_leased()
            self._room.changed()
        log.info("model %s unloaded%s", model_id, f" ({reason})" if reason else "")

    async def close(self, *, timeout_s: float = 30.0) -> None:
        """Refuse new work, drain and unload every model, release every lease."""
        self._closing = True
        await self._keep_alive.stop()
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
                if (lease := self._keeper.forget(model_id) or loaded.lease) is not None:
                    await self._release(model_id, lease)
        await self._keeper.close()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    # ---- release: what a model holds, and when it is taken away --------------

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
        if (
            loaded.memory_before
            and loaded.lease is not None
            and not await memory.wait_freed(
                loaded.memory_before, dict(loaded.lease.mb_per_gpu), clock=self._clock
            )
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

    # ---- metrics -----------------------------------------------------------

    def _record_batch(self, model_id: str, size: int, inference_ms: float) -> None:
        labels = {"model": model_id}
        self._record("inference_latency_ms", inference_ms, labels)
        self._record("batch_size", float(size), labels)

    def _record_leased(self) -> None:
        for gpu, mb in self.leased_mb_per_gpu().items():
            self._record("worker_leased_mb", float(mb), {"gpu": str(gpu)})
        for gpu in self._reported_gpus - set(self.leased_mb_per_gpu()):
            self._record("worker_leased_mb", 0.0, {"gpu": str(gpu)})
        self._reported_gpus |= set(self.leased_mb_per_gpu())

    def _record(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        if self._metrics is not None:
            self._metrics.record(name, value, labels)


def _always() -> bool:
    """A model without a lease (a hosted API) is usable whenever it is loaded."""
    return True
