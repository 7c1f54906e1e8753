"""Dynamic batching: concurrent requests for one model stacked on dim 0, run once, split back.

    batcher = Batcher(model_id, policy, instances=[...], clock=clock)
    outputs, timing = await batcher.submit(inputs, deadline_unix_ns=..., received=...)

One `Batcher` per loaded model. Requests wait in arrival order; whenever an instance
(one engine copy with its own thread) is free, the batcher takes the head request and
every queued request that can be stacked with it (same tensor names, dtypes and
trailing shapes; rows summed up to `max_batch_size`). When the batch is short of
`max_batch_size` and of every preferred size, it waits at most `max_queue_delay_ms`
(counted from the head's arrival) for more. A model with `max_batch_size` 1 runs one
request per call, in arrival order, through the same path.

Errors stay per request: a request whose deadline passed is answered `expired` and
left out; when a stacked call fails (or returns outputs without the batch rows) each
request of that batch runs again on its own, so only the request at fault fails.

The stacking and splitting are pure functions (`stack`, `split`, `take_batch`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from loadmaster.common.clock import Clock
from loadmaster.common.config import ModelSettings
from loadmaster.common.errors import ExpiredError, InternalError, InvalidArgumentError, LoadmasterError
from loadmaster.common.tensors import wire_dtype
from loadmaster.model_pool._waiting import event_or_timeout
from loadmaster.model_pool.engines.base import Engine

__all__ = [
    "BatchPolicy",
    "BatchTiming",
    "Batcher",
    "Instance",
    "batch_policy",
    "rows",
    "signature",
    "split",
    "stack",
    "take_batch",
]

log = logging.getLogger(__name__)

Arrays = Mapping[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    max_batch_size: int = 1
    max_queue_delay_ms: float = 0.0
    preferred_batch_sizes: tuple[int, ...] = ()

    @property
    def batching(self) -> bool:
        return self.max_batch_size > 1


def batch_policy(config: object, settings: ModelSettings) -> BatchPolicy:
    """The model's config.yaml values under the deployment's `models.known.<id>` overrides."""
    size = settings.max_batch_size or int(getattr(config, "max_batch_size", 1))
    delay = settings.max_queue_delay_ms
    if delay is None:
        delay = float(getattr(config, "max_queue_delay_ms", 0.0))
    preferred = settings.preferred_batch_sizes
    if preferred is None:
        preferred = list(getattr(config, "preferred_batch_sizes", ()))
    return BatchPolicy(
        max_batch_size=size,
        max_queue_delay_ms=delay,
        preferred_batch_sizes=tuple(sorted({p for p in preferred if 1 <= p <= size})),
    )


@dataclass(frozen=True, slots=True)
class BatchTiming:
    queue_ms: float  # receipt to engine start
    inference_ms: float  # the engine call (the whole batch)
    batch_size: int  # requests in the engine call


@dataclass(slots=True)
class Instance:
    """One engine copy with its own thread."""

    engine: Engine
    executor: ThreadPoolExecutor


@dataclass(slots=True)
class _Item:
    inputs: Arrays
    deadline_unix_ns: int
    received: float
    future: asyncio.Future[tuple[dict[str, np.ndarray], BatchTiming]]
    rows: int = 1
    signature: tuple[tuple[str, str, tuple[int, ...]], ...] = field(default_factory=tuple)


# ---- pure helpers ------------------------------------------------------------


def rows(inputs: Arrays) -> int | None:
    """Rows on dim 0 shared by every input, or None when they cannot be stacked."""
    counts = {array.shape[0] if array.ndim else -1 for array in inputs.values()}
    if len(counts) != 1:
        return None
    (count,) = counts
    return count if count >= 1 else None


def signature(inputs: Arrays) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """What must match for requests to be stacked: names, dtypes, shapes after dim 0."""
    return tuple(sorted((name, array.dtype.str, tuple(array.shape[1:])) for name, array in inputs.items()))


def stack(requests: Sequence[Arrays]) -> dict[str, np.ndarray]:
    """Concatenate each input over the requests on dim 0."""
    if len(requests) == 1:
        return dict(requests[0])
    return {name: np.concatenate([r[name] for r in requests], axis=0) for name in requests[0]}


def split(outputs: Arrays, counts: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """Cut each output back into per-request slices; ValueError when dim 0 is not the total rows."""
    total = sum(counts)
    if len(counts) == 1:
        return [dict(outputs)]
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] != total:
            raise ValueError(
                f"output '{name}' has shape {list(array.shape)}, expected {total} rows on dim 0 for a batch"
            )
    bounds = np.cumsum([0, *counts])
    return [
        {name: array[bounds[i] : bounds[i + 1]] for name, array in outputs.items()}
        for i in range(len(counts))
    ]


def take_batch(sizes: Sequence[int], signatures: Sequence[object], *, max_rows: int) -> int:
    """How many queued requests (from the head) form the next batch: same signature, rows <= max_rows."""
    if not sizes:
        return 0
    total = sizes[0]
    taken = 1
    for size, sig in zip(sizes[1:], signatures[1:], strict=True):
        if sig != signatures[0] or total + size > max_rows:
            break
        total += size
        taken += 1
    return taken


def _complete(policy: BatchPolicy, total_rows: int) -> bool:
    return total_rows >= policy.max_batch_size or total_rows in policy.preferred_batch_sizes


def _check_outputs(model_id: str, outputs: Arrays) -> None:
    for key, array in outputs.items():
        try:
            wire_dtype(array.dtype)
        except InvalidArgumentError:
            raise InternalError(
                f"model '{model_id}' output '{key}' has dtype {array.dtype}, which cannot travel on the wire"
            ) from None


# ---- the batcher -------------------------------------------------------------


class Batcher:
    """Queues one model's requests and runs them, stacked when the policy allows. Event-loop only."""

    def __init__(
        self,
        model_id: str,
        policy: BatchPolicy,
        *,
        instances: Sequence[Instance],
        clock: Clock,
        on_batch: Callable[[int, float], None] | None = None,
    ) -> None:
        if not instances:
            raise ValueError("a batcher needs at least one instance")
        self.model_id = model_id
        self.policy = policy
        self._clock = clock
        self._on_batch = on_batch
        self._queue: deque[_Item] = deque()
        self._arrived = asyncio.Event()
        self._free: asyncio.Queue[Instance] = asyncio.Queue()
        for instance in instances:
            self._free.put_nowait(instance)
        self._running: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run(), name=f"batcher-{self.model_id}")

    async def close(self) -> None:
        """Stop taking batches and wait for running ones. Callers drain first; anything still
        queued is answered `internal` (a bug in the caller, never silence)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        while self._queue:
            item = self._queue.popleft()
            if not item.future.done():
                item.future.set_exception(InternalError(f"model '{self.model_id}' stopped"))

    def submit(
        self, inputs: Arrays, *, deadline_unix_ns: int, received: float
    ) -> asyncio.Future[tuple[dict[str, np.ndarray], BatchTiming]]:
        future: asyncio.Future[tuple[dict[str, np.ndarray], BatchTiming]] = (
            asyncio.get_running_loop().create_future()
        )
        item = _Item(inputs=inputs, deadline_unix_ns=deadline_unix_ns, received=received, future=future)
        if self.policy.batching:
            count = rows(inputs)
            if count is None or count > self.policy.max_batch_size:
                future.set_exception(
                    InvalidArgumentError(
                        f"model '{self.model_id}' batches on dim 0: every input needs the same number "
                        f"of rows, 1..{self.policy.max_batch_size}"
                    )
                )
                return future
            item.rows = count
            item.signature = signature(inputs)
        self._queue.append(item)
        self._arrived.set()
        return future

    async def _run(self) -> None:
        while True:
            try:
                instance = await self._free.get()
                batch = await self._collect()
                task = asyncio.create_task(self._execute(instance, batch))
                self._running.add(task)
                task.add_done_callback(self._running.discard)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("batcher of %s failed a step", self.model_id)

    async def _collect(self) -> list[_Item]:
        while not self._queue:
            self._arrived.clear()
            await self._arrived.wait()
        if not self.policy.batching:
            return [self._queue.popleft()]
        deadline = self._queue[0].received + self.policy.max_queue_delay_ms / 1000.0
        while True:
            taken = self._candidates()
            total = sum(item.rows for item in list(self._queue)[:taken])
            now = self._clock.monotonic()
            blocked = taken < len(self._queue)  # the next request cannot join this batch
            if blocked or _complete(self.policy, total) or now >= deadline:
                break
            self._arrived.clear()
            await event_or_timeout(self._arrived, self._clock, deadline - now)
        return [self._queue.popleft() for _ in range(self._candidates())]

    def _candidates(self) -> int:
        queued = list(self._queue)
        return take_batch(
            [item.rows for item in queued],
            [item.signature for item in queued],
            max_rows=self.policy.max_batch_size,
        )

    async def _execute(self, instance: Instance, batch: list[_Item]) -> None:
        loop = asyncio.get_running_loop()
        calls: list[tuple[int, float]] = []
        try:
            results = await loop.run_in_executor(
                instance.executor, self._run_batch, instance.engine, batch, calls
            )
        except BaseException as error:  # the executor itself failed: every request hears it
            results = [error] * len(batch)
        finally:
            self._free.put_nowait(instance)
        if self._on_batch is not None:
            for size, inference_ms in calls:
                try:
                    self._on_batch(size, inference_ms)
                except Exception:
                    log.exception("batch observer failed")
        for item, result in zip(batch, results, strict=True):
            if item.future.done():
                continue
            if isinstance(result, BaseException):
                item.future.set_exception(result)
            else:
                item.future.set_result(result)

    # ---- on the instance's thread -----------------------------------------------

    def _run_batch(
        self, engine: Engine, batch: list[_Item], calls: list[tuple[int, float]]
    ) -> list[tuple[dict[str, np.ndarray], BatchTiming] | BaseException]:
        now_ns = self._clock.time() * 1e9
        results: list[tuple[dict[str, np.ndarray], BatchTiming] | BaseException] = []
        live: list[int] = []
        started = self._clock.monotonic()
        for index, item in enumerate(batch):
            if item.deadline_unix_ns and now_ns >= item.deadline_unix_ns:
                queue_ms = (started - item.received) * 1000.0
                results.append(
                    ExpiredError(
                        f"request for '{self.model_id}' expired after {queue_ms:.1f} ms in the model's queue"
                    )
                )
            else:
                results.append(InternalError("not run"))
                live.append(index)
        if not live:
            return results
        items = [batch[i] for i in live]
        try:
            outputs = engine.infer(stack([item.inputs for item in items]))
            parts = split(outputs, [item.rows for item in items])
            for part in parts:
                _check_outputs(self.model_id, part)
        except Exception as error:
            if len(items) == 1:
                results[live[0]] = self._engine_error(error)
                calls.append((1, (self._clock.monotonic() - started) * 1000.0))
                return results
            log.warning(
                "model %s failed a batch of %d (%s); running its requests one by one",
                self.model_id,
                len(items),
                error,
            )
            for index in live:
                results[index] = self._run_single(engine, batch[index], calls)
            return results
        inference_ms = (self._clock.monotonic() - started) * 1000.0
        calls.append((len(items), inference_ms))
        for index, item, part in zip(live, items, parts, strict=True):
            timing = BatchTiming(
                queue_ms=(started - item.received) * 1000.0, inference_ms=inference_ms, batch_size=len(items)
            )
            results[index] = (part, timing)
        return results

    def _run_single(
        self, engine: Engine, item: _Item, calls: list[tuple[int, float]]
    ) -> tuple[dict[str, np.ndarray], BatchTiming] | BaseException:
        started = self._clock.monotonic()
        try:
            outputs = engine.infer(item.inputs)
            _check_outputs(self.model_id, outputs)
        except Exception as error:
            return self._engine_error(error)
        inference_ms = (self._clock.monotonic() - started) * 1000.0
        calls.append((1, inference_ms))
        return outputs, BatchTiming(
            queue_ms=(started - item.received) * 1000.0, inference_ms=inference_ms, batch_size=1
        )

    def _engine_error(self, error: Exception) -> BaseException:
        if isinstance(error, LoadmasterError):
            return error
        log.error("model %s failed on a request", self.model_id, exc_info=error)
        return InternalError(f"model '{self.model_id}' failed: {type(error).__name__}: {error}")
