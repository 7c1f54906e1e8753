"""Dynamic batching: concurrent requests for one model stacked on dim 0, run once, split back.

    batcher = Batcher(model_id, policy, instances=[...], clock=clock)
    batcher.start()
    batcher.submit(inputs, deadline_unix_ns=..., received=..., done=callback)
    # later, on the event loop: callback((outputs, timing)) or callback(error)

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

The hot path costs per batch, not per request: submissions only append to the queue
and schedule one look at it for the next loop iteration (so a burst received in one
go is batched whole), a batch reaches its instance's thread with one `InstanceThread.post`
(a `SimpleQueue.put`: no Future, work item or semaphore), and every request of it is
answered by a plain callback on the loop (no Future or Task per request). Only a partial
batch waiting for company holds a timer task. An instance that finishes a batch while the
next one is ready in the queue runs it straight away on its thread: going back to the
loop for it would leave the model idle for a wake-up of each thread (0.3-0.5 ms on a
loaded 2-core machine, 5 % of a 10 ms model). The queue is shared with the instances'
threads under a lock for that. Finished batches go back the same way, through a list
under that lock (`_finished`): the thread that adds to an empty list wakes the loop with
one `call_soon_threadsafe`, and every batch that finishes before the loop has taken the
list rides on that wake-up (a chain of batches, or several instances, cost one).

The stacking and splitting are pure functions (`stack`, `split`, `take_batch`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from loadmaster.common.clock import Clock
from loadmaster.common.config import ModelSettings
from loadmaster.common.errors import (
    ExpiredError,
    InternalError,
    InvalidArgumentError,
    LoadmasterError,
    UnavailableError,
)
from loadmaster.common.tensors import wire_dtype
from loadmaster.model_pool.engines.base import Engine
from loadmaster.model_pool.instance_thread import InstanceThread

__all__ = [
    "BatchOutcome",
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
    batch_id: int = 0  # the engine call's number in its batcher: requests with the same one ran together


@dataclass(slots=True)
class Instance:
    """One engine copy with its own thread."""

    engine: Engine
    thread: InstanceThread


# What a request comes to: its outputs and timing, or the error that answers it.
BatchOutcome = tuple[dict[str, np.ndarray], BatchTiming] | BaseException
Signature = tuple[tuple[str, np.dtype, tuple[int, ...]], ...]


@dataclass(slots=True)
class _Item:
    inputs: Arrays
    deadline_unix_ns: int
    received: float
    done: Callable[[BatchOutcome], None]
    rows: int = 1
    signature: Signature = ()
    front: bool = False  # queued ahead of the others (Grant.front_of_queue)


# A batch that ran, for the loop to answer: its instance, requests, engine calls (size, ms),
# each request's outcome, and whether its instance is free again.
_Finished = tuple[Instance, list[_Item], list[tuple[int, float]], list[BatchOutcome], bool]

# Stands for a result in the list being filled while its batch runs; never delivered.
_NOT_RUN = InternalError("not run")

# ---- pure helpers ------------------------------------------------------------


def rows(inputs: Arrays) -> int | None:
    """Rows on dim 0 shared by every input, or None when they cannot be stacked."""
    count = None
    for array in inputs.values():
        size = array.shape[0] if array.ndim else 0
        if count is None:
            count = size
        elif size != count:
            return None
    return count or None


def signature(inputs: Arrays) -> Signature:
    """What must match for requests to be stacked: names, dtypes, shapes after dim 0."""
    # The dtype itself, not its `.str` (a new string per call): equal dtypes compare equal, and
    # decoded inputs share one dtype object per wire dtype, so the comparison is an identity.
    if len(inputs) == 1:  # the usual case, without a list to sort
        ((name, array),) = inputs.items()
        return ((name, array.dtype, array.shape[1:]),)
    # Names are unique, so sorting never compares the dtypes (which do not order).
    return tuple(sorted(((name, array.dtype, array.shape[1:]) for name, array in inputs.items()), key=_first))


def _first(entry: tuple[str, np.dtype, tuple[int, ...]]) -> str:
    return entry[0]


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
    bounds = [0, *itertools.accumulate(counts)]
    return [
        {name: array[start:end] for name, array in outputs.items()}
        for start, end in itertools.pairwise(bounds)
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
        usable: Callable[[], bool] | None = None,
    ) -> None:
        """`usable`: asked on the instance's thread before every engine call (the model's GPU
        lease is live); while it says no, requests are answered `unavailable` instead of run."""
        if not instances:
            raise ValueError("a batcher needs at least one instance")
        self.model_id = model_id
        self.policy = policy
        self._clock = clock
        self._on_batch = on_batch
        self._usable = usable
        self._queue: deque[_Item] = deque()
        self._lock = threading.Lock()  # the queue, between the loop and the instances' threads
        self._free: list[Instance] = list(instances)
        self._busy = 0  # batches on instance threads
        self._idle = asyncio.Event()  # set while no batch is running
        self._idle.set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pump_scheduled = False
        self._timer: asyncio.Task[None] | None = None  # wakes a partial batch at its queue deadline
        self._timer_at = math.inf
        self._closed = False
        self._batch_ids = itertools.count(1)  # next() is atomic: instances' threads share it
        # Under the lock, while batching: the rows queued, and whether any two queued requests
        # cannot be stacked (False guarantees they all can; True may be stale, which only costs
        # `_take` a full look).
        self._rows = 0
        self._mixed = False
        # Under the lock: batches finished on the instances' threads, for the loop to answer,
        # and whether a wake-up of the loop for them is on its way.
        self._finished: list[_Finished] = []
        self._finish_scheduled = False

    def start(self) -> None:
        """Start taking batches (requests submitted before wait until then)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._schedule()

    async def close(self) -> None:
        """Stop taking batches and wait for running ones. Callers drain first; anything still
        queued is answered `internal` (a bug in the caller, never silence)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            await asyncio.gather(self._timer, return_exceptions=True)
            self._timer = None
        await self._idle.wait()
        with self._lock:
            left, self._queue = list(self._queue), deque()
            self._rows, self._mixed = 0, False
        for item in left:
            self._deliver(item, InternalError(f"model '{self.model_id}' stopped"))

    def submit(
        self,
        inputs: Arrays,
        *,
        deadline_unix_ns: int,
        received: float,
        done: Callable[[BatchOutcome], None],
        front: bool = False,
    ) -> None:
        """Queue one request (`front`: ahead of those waiting); `done` is called once, on the event
        loop, with its outcome. Raises (and queues nothing) when the batcher is closed or the
        inputs cannot be stacked."""
        if self._closed:
            raise InternalError(f"model '{self.model_id}' stopped")
        item = _Item(inputs=inputs, deadline_unix_ns=deadline_unix_ns, received=received, done=done)
        if self.policy.batching:
            count = rows(inputs)
            if count is None or count > self.policy.max_batch_size:
                raise InvalidArgumentError(
                    f"model '{self.model_id}' batches on dim 0: every input needs the same number "
                    f"of rows, 1..{self.policy.max_batch_size}"
                )
            item.rows = count
            item.signature = signature(inputs)
        with self._lock:
            queue = self._queue
            if self.policy.batching:
                if queue and (queue[0] if front else queue[-1]).signature != item.signature:
                    self._mixed = True
                self._rows += item.rows
            if front:
                # ahead of those waiting, behind earlier front-of-queue requests (as urgent, and first)
                item.front = True
                at = 0
                while at < len(queue) and queue[at].front:
                    at += 1
                queue.insert(at, item)
            else:
                queue.append(item)
        self._schedule()

    # ---- scheduling, on the event loop -------------------------------------------

    def _schedule(self) -> None:
        """Look at the queue once the current loop iteration is over (after the whole burst)."""
        if not self._pump_scheduled and self._loop is not None:
            self._pump_scheduled = True
            self._loop.call_soon(self._pump)

    def _pump(self) -> None:
        """Hand every batch that is ready to a free instance."""
        self._pump_scheduled = False
        try:
            while self._free:
                with self._lock:
                    batch = self._take(on_loop=True)
                if batch is None:
                    return
                self._launch(self._free.pop(), batch)
        except Exception:
            log.exception("batcher of %s failed a step", self.model_id)

    def _take(self, *, on_loop: bool) -> list[_Item] | None:
        """Under the lock: take the requests (from the head) that go now; None while there are
        none or a partial batch waits for company (on the loop, its timer is armed then; an
        instance's thread leaves that to the loop)."""
        queue = self._queue
        if not queue or self._closed:
            return None
        policy = self.policy
        if not policy.batching:
            return [queue.popleft()]
        if not self._mixed and not _complete(policy, self._rows):
            # The usual look while a batch fills up: every queued request stacks with the head and
            # together they are short of a batch, so they all go at the head's queue deadline.
            taken = len(queue)
            deadline = queue[0].received
        else:
            head = list(itertools.islice(queue, policy.max_batch_size))
            taken = take_batch(
                [item.rows for item in head],
                [item.signature for item in head],
                max_rows=policy.max_batch_size,
            )
            blocked = taken < len(queue)  # the next request cannot join this batch
            complete = blocked or _complete(policy, sum(item.rows for item in head[:taken]))
            deadline = -math.inf if complete else head[0].received
        if deadline > -math.inf:
            deadline += policy.max_queue_delay_ms / 1000.0
            now = self._clock.monotonic()
            if now < deadline:
                if on_loop:
                    self._wake_at(deadline, now)
                return None
        batch = [queue.popleft() for _ in range(taken)]
        if queue:
            self._rows -= sum(item.rows for item in batch)
        else:
            self._rows, self._mixed = 0, False
        return batch

    def _wake_at(self, deadline: float, now: float) -> None:
        if self._timer is not None:
            if self._timer_at <= deadline:
                return  # an earlier wake-up looks again and re-arms
            self._timer.cancel()
        assert self._loop is not None
        self._timer_at = deadline
        self._timer = self._loop.create_task(self._wake(deadline - now))

    async def _wake(self, seconds: float) -> None:
        await self._clock.sleep(seconds)
        self._timer, self._timer_at = None, math.inf
        self._pump()

    def _launch(self, instance: Instance, batch: list[_Item]) -> None:
        """One post to the instance's thread; the results come back through `_finished`."""
        try:
            instance.thread.post(self._run_chain, instance, batch)
        except BaseException as error:  # the thread is gone (shut down): every request hears it
            self._free.append(instance)
            self._answer(batch, [error] * len(batch), [])
            return
        self._busy += 1
        self._idle.clear()

    def _finish_all(self) -> None:
        """On the loop: answer every batch finished since the last look, in the order they ended."""
        with self._lock:
            finished, self._finished = self._finished, []
            self._finish_scheduled = False
        for entry in finished:
            try:
                self._finish(*entry)
            except Exception:
                log.exception("batcher of %s failed a step", self.model_id)

    def _finish(
        self,
        instance: Instance,
        batch: list[_Item],
        calls: list[tuple[int, float]],
        results: list[BatchOutcome],
        last: bool,
    ) -> None:
        """On the loop: a batch's results; `last`: its instance is free again."""
        if last:
            self._busy -= 1
            self._free.append(instance)
            self._pump()  # the instance starts its next batch while these replies go out
            if not self._busy:
                self._idle.set()
        self._answer(batch, results, calls)

    def _answer(
        self, batch: list[_Item], results: list[BatchOutcome], calls: list[tuple[int, float]]
    ) -> None:
        if self._on_batch is not None:
            for size, inference_ms in calls:
                try:
                    self._on_batch(size, inference_ms)
                except Exception:
                    log.exception("batch observer failed")
        for item, result in zip(batch, results, strict=True):
            self._deliver(item, result)

    def _deliver(self, item: _Item, outcome: BatchOutcome) -> None:
        try:
            item.done(outcome)
        except Exception:
            log.exception("answering a request failed", extra={"model": self.model_id})

    # ---- on the instance's thread -----------------------------------------------

    def _run_chain(self, instance: Instance, batch: list[_Item]) -> None:
        """Run `batch`, then each next batch that is ready when this one ends, handing every
        batch's results to the loop as it ends; the last one frees the instance."""
        loop = self._loop
        assert loop is not None
        while True:
            calls: list[tuple[int, float]] = []
            try:
                results = self._run_batch(instance.engine, batch, calls)
            except Exception as error:  # a bug on this path: every request of the batch hears it
                results = [error] * len(batch)
            with self._lock:
                following = self._take(on_loop=False)
                self._finished.append((instance, batch, calls, results, following is None))
                wake = not self._finish_scheduled
                self._finish_scheduled = True
            if wake:
                try:
                    loop.call_soon_threadsafe(self._finish_all)
                except RuntimeError:  # the loop is closed: nobody is left to answer
                    log.warning("model %s finished a batch after its event loop closed", self.model_id)
                    return
            if following is None:
                return
            batch = following

    def _run_batch(
        self, engine: Engine, batch: list[_Item], calls: list[tuple[int, float]]
    ) -> list[BatchOutcome]:
        started = self._clock.monotonic()
        if self._usable is not None and not self._usable():
            lapsed = UnavailableError(f"model '{self.model_id}' has no live GPU lease; not serving it")
            return [lapsed] * len(batch)
        results: list[BatchOutcome] = [_NOT_RUN] * len(batch)  # each replaced below
        if any(item.deadline_unix_ns for item in batch):
            now_ns = self._clock.time() * 1e9
            live: list[int] = []
            for index, item in enumerate(batch):
                if item.deadline_unix_ns and now_ns >= item.deadline_unix_ns:
                    queue_ms = (started - item.received) * 1000.0
                    results[index] = ExpiredError(
                        f"request for '{self.model_id}' expired after {queue_ms:.1f} ms in the model's queue"
                    )
                else:
                    live.append(index)
            if not live:
                return results
            items = [batch[i] for i in live]
        else:
            live, items = list(range(len(batch))), batch
        try:
            outputs = engine.infer(stack([item.inputs for item in items]))
            _check_outputs(self.model_id, outputs)  # once for the batch: its parts share the dtypes
            parts = split(outputs, [item.rows for item in items])
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
        size = len(items)
        calls.append((size, inference_ms))
        batch_id = next(self._batch_ids)
        for index, item, part in zip(live, items, parts, strict=True):
            results[index] = (
                part,
                BatchTiming((started - item.received) * 1000.0, inference_ms, size, batch_id),
            )
        return results

    def _run_single(self, engine: Engine, item: _Item, calls: list[tuple[int, float]]) -> BatchOutcome:
        started = self._clock.monotonic()
        try:
            outputs = engine.infer(item.inputs)
            _check_outputs(self.model_id, outputs)
        except Exception as error:
            return self._engine_error(error)
        inference_ms = (self._clock.monotonic() - started) * 1000.0
        calls.append((1, inference_ms))
        return outputs, BatchTiming(
            (started - item.received) * 1000.0, inference_ms, 1, next(self._batch_ids)
        )

    def _engine_error(self, error: Exception) -> BaseException:
        if isinstance(error, LoadmasterError):
            return error
        log.error("the model failed on a request", exc_info=error, extra={"model": self.model_id})
        return InternalError(f"model '{self.model_id}' failed: {type(error).__name__}: {error}")
