"""Admission of requests and generation streams on READY models: the inference half of
`ModelPool` (see pool.py), as a base class it inherits, and the values it hands back."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadmaster.common.clock import Clock
from loadmaster.common.errors import ExpiredError, InvalidArgumentError, UnavailableError
from loadmaster.model_pool.batcher import Batcher, BatchOutcome, Instance
from loadmaster.model_pool.keep_alive import KeepAlive
from loadmaster.model_pool.leases import Lease, WorkerLeases
from loadmaster.model_pool.repository import ModelSpec, check_inputs
from loadmaster.model_pool.room import Room
from loadmaster.model_pool.slots import Slot

__all__ = ["GenerationAdmission", "InferResult"]


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


class _Admission:
    """`submit`, `infer` and `open_generation` of `ModelPool`, over the state it owns."""

    _closing: bool
    _clock: Clock
    _keeper: WorkerLeases
    _keep_alive: KeepAlive
    _loaded: dict[str, _Loaded]
    _room: Room

    def _slot(self, model_id: str) -> Slot:
        raise NotImplementedError

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
        waiting there, see Grant.front_of_queue); `done` is called once, on the
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
