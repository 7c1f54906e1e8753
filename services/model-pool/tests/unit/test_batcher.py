"""Dynamic batching: stacking, splitting, queue delay on a fake clock, per-request errors."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.common.config import ModelSettings
from loadmaster.common.errors import ExpiredError, InternalError, InvalidArgumentError
from loadmaster.model_pool.batcher import (
    Batcher,
    BatchOutcome,
    BatchPolicy,
    BatchTiming,
    Instance,
    batch_policy,
    rows,
    signature,
    split,
    stack,
    take_batch,
)
from loadmaster.model_pool.engines.base import Engine, EngineContext
from loadmaster.model_pool.instance_thread import InstanceThread
from loadmaster.model_pool.repository import ModelSpec, parse_config


class Doubler(Engine):
    """Test double: x * 2, records the rows of each call; refuses any input holding -1."""

    backend = "python"

    def __init__(self, spec: ModelSpec, context: EngineContext) -> None:
        super().__init__(spec, context)
        self.calls: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    @classmethod
    def artifact_files(cls, spec: ModelSpec) -> Iterable[Path]:
        return []

    def load(self) -> None:
        pass

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.gate.wait(5)
        x = inputs["x"]
        self.calls.append(int(x.shape[0]))
        if (x == -1).any():
            raise ValueError("poisoned row")
        return {"y": x * 2}

    def unload(self) -> None:
        pass


def _spec() -> ModelSpec:
    return parse_config("m", Path("."), {"backend": "python", "class": "M"})


@pytest.fixture
def engine() -> Doubler:
    return Doubler(_spec(), EngineContext(device="cpu"))


def make(
    engine: Doubler, policy: BatchPolicy, clock: FakeClock, sizes: list[int]
) -> tuple[Batcher, InstanceThread]:
    executor = InstanceThread("test-instance")
    batcher = Batcher(
        "m",
        policy,
        instances=[Instance(engine=engine, thread=executor)],
        clock=clock,
        on_batch=lambda size, ms: sizes.append(size),
    )
    batcher.start()
    return batcher, executor


def submit(
    batcher: Batcher,
    inputs: dict[str, np.ndarray],
    *,
    deadline_unix_ns: int = 0,
    received: float,
    front: bool = False,
) -> asyncio.Future[tuple[dict[str, np.ndarray], BatchTiming]]:
    """The batcher's callback as a future, so a test can await each request."""
    future: asyncio.Future[tuple[dict[str, np.ndarray], BatchTiming]] = (
        asyncio.get_running_loop().create_future()
    )

    def done(outcome: BatchOutcome) -> None:
        assert not future.done(), "a request was answered twice"
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    batcher.submit(inputs, deadline_unix_ns=deadline_unix_ns, received=received, done=done, front=front)
    return future


def x(*values: float) -> dict[str, np.ndarray]:
    return {"x": np.array([[v] for v in values], dtype=np.float32)}


def test_stack_split_rows_signature() -> None:
    a, b = x(1), x(2, 3)
    stacked = stack([a, b])
    assert stacked["x"].shape == (3, 1)
    parts = split({"y": stacked["x"] * 2}, [1, 2])
    assert [p["y"].ravel().tolist() for p in parts] == [[2.0], [4.0, 6.0]]
    assert rows(b) == 2
    assert rows({"a": np.zeros((2, 1)), "b": np.zeros((3, 1))}) is None
    assert rows({"s": np.zeros(())}) is None
    assert signature(a) == signature(b)
    assert signature(a) != signature({"x": np.zeros((1, 2), dtype=np.float32)})
    with pytest.raises(ValueError, match="expected 3 rows"):
        split({"y": np.zeros((1,))}, [1, 2])


def test_take_batch_stops_at_max_rows_and_at_an_incompatible_request() -> None:
    assert take_batch([1, 1, 1], ["s", "s", "s"], max_rows=2) == 2
    assert take_batch([1, 2, 1], ["s", "s", "s"], max_rows=4) == 3
    assert take_batch([1, 1, 1], ["s", "t", "s"], max_rows=8) == 1
    assert take_batch([], [], max_rows=8) == 0


def test_policy_from_config_and_overrides() -> None:
    config = parse_config(
        "m",
        Path("."),
        {"backend": "python", "class": "M", "max_batch_size": 4, "preferred_batch_sizes": [4, 2]},
    ).config
    assert batch_policy(config, ModelSettings()) == BatchPolicy(4, 0.0, (2, 4))
    assert batch_policy(config, ModelSettings(max_batch_size=16, max_queue_delay_ms=3)) == BatchPolicy(
        16, 3.0, (2, 4)
    )
    assert batch_policy(config, ModelSettings(max_batch_size=1)).batching is False


async def test_concurrent_requests_are_stacked_and_split_back(engine: Doubler) -> None:
    clock, sizes = FakeClock(), []
    batcher, executor = make(engine, BatchPolicy(max_batch_size=8), clock, sizes)
    engine.gate.clear()  # the first request holds the instance while the others queue
    first = submit(batcher, x(0), deadline_unix_ns=0, received=clock.monotonic())
    await asyncio.sleep(0.05)
    rest = [
        submit(batcher, x(i, i + 0.5), deadline_unix_ns=0, received=clock.monotonic()) for i in range(1, 4)
    ]
    engine.gate.set()
    results = await asyncio.gather(first, *rest)
    assert engine.calls == [1, 6]  # one alone, then three requests of two rows in one call
    assert sizes == [1, 3]
    for i, (outputs, timing) in enumerate(results[1:], start=1):
        assert outputs["y"].ravel().tolist() == [2 * i, 2 * i + 1]
        assert timing.batch_size == 3
    await batcher.close()
    executor.shutdown()


async def test_queue_delay_waits_for_company_on_the_clock(engine: Doubler) -> None:
    clock, sizes = FakeClock(), []
    batcher, executor = make(engine, BatchPolicy(max_batch_size=4, max_queue_delay_ms=50), clock, sizes)
    one = submit(batcher, x(1), deadline_unix_ns=0, received=clock.monotonic())
    await asyncio.sleep(0.05)
    assert engine.calls == []  # waiting for the delay to pass
    two = submit(batcher, x(2), deadline_unix_ns=0, received=clock.monotonic())
    await asyncio.sleep(0.05)
    assert engine.calls == []
    clock.advance(0.05)
    await asyncio.gather(one, two)
    assert engine.calls == [2]
    # A full batch does not wait.
    full = [submit(batcher, x(i), deadline_unix_ns=0, received=clock.monotonic()) for i in range(4)]
    await asyncio.gather(*full)
    assert engine.calls == [2, 4]
    await batcher.close()
    executor.shutdown()


async def test_preferred_size_goes_without_waiting(engine: Doubler) -> None:
    clock, sizes = FakeClock(), []
    policy = BatchPolicy(max_batch_size=8, max_queue_delay_ms=1000, preferred_batch_sizes=(2,))
    batcher, executor = make(engine, policy, clock, sizes)
    pair = [submit(batcher, x(i), deadline_unix_ns=0, received=clock.monotonic()) for i in range(2)]
    await asyncio.gather(*pair)  # never advanced the clock
    assert engine.calls == [2]
    await batcher.close()
    executor.shutdown()


async def test_errors_stay_per_request(engine: Doubler) -> None:
    clock, sizes = FakeClock(), []
    batcher, executor = make(engine, BatchPolicy(max_batch_size=8), clock, sizes)
    engine.gate.clear()
    blocker = submit(batcher, x(0), deadline_unix_ns=0, received=clock.monotonic())
    await asyncio.sleep(0.05)
    good = submit(batcher, x(1), deadline_unix_ns=0, received=clock.monotonic())
    bad = submit(batcher, x(-1), deadline_unix_ns=0, received=clock.monotonic())
    expired = submit(batcher, x(3), deadline_unix_ns=int(clock.time() * 1e9) - 1, received=clock.monotonic())
    engine.gate.set()
    await blocker
    assert (await good)[0]["y"].ravel().tolist() == [2.0]
    with pytest.raises(InternalError, match="poisoned row"):
        await bad
    with pytest.raises(ExpiredError):
        await expired
    assert engine.calls == [1, 2, 1, 1]  # the failed pair ran again one by one
    await batcher.close()
    executor.shutdown()


async def test_unstackable_requests_are_refused_by_name(engine: Doubler) -> None:
    clock = FakeClock()
    batcher, executor = make(engine, BatchPolicy(max_batch_size=2), clock, [])
    with pytest.raises(InvalidArgumentError, match=r"1\.\.2"):
        submit(batcher, x(1, 2, 3), deadline_unix_ns=0, received=clock.monotonic())
    await batcher.close()
    executor.shutdown()


async def test_unbatched_models_run_one_at_a_time_in_order(engine: Doubler) -> None:
    clock = FakeClock()
    batcher, executor = make(engine, BatchPolicy(max_batch_size=1), clock, [])
    results = await asyncio.gather(
        *(submit(batcher, x(i), deadline_unix_ns=0, received=clock.monotonic()) for i in range(5))
    )
    assert engine.calls == [1] * 5
    assert [r[0]["y"].item() for r in results] == [0.0, 2.0, 4.0, 6.0, 8.0]
    await batcher.close()
    executor.shutdown()


async def test_an_instance_runs_the_next_ready_request_without_the_loop(engine: Doubler) -> None:
    """A request queued behind a running one starts when that one ends even while the event
    loop is busy: the instance's thread takes it (a loop round trip would idle the model)."""
    clock, sizes = FakeClock(), []
    batcher, executor = make(engine, BatchPolicy(max_batch_size=1), clock, sizes)
    engine.gate.clear()
    first = submit(batcher, x(1), received=clock.monotonic())
    await asyncio.sleep(0.05)  # running, held at the gate
    second = submit(batcher, x(2), received=clock.monotonic())
    await asyncio.sleep(0.05)  # queued: no instance is free
    engine.gate.set()
    give_up = time.monotonic() + 5.0
    while len(engine.calls) < 2 and time.monotonic() < give_up:  # the loop is blocked here
        time.sleep(0.001)
    assert engine.calls == [1, 1]
    assert not first.done()  # its answer waits for the loop
    outputs = await asyncio.gather(first, second)
    assert [o["y"].ravel().tolist() for o, _ in outputs] == [[2.0], [4.0]]
    assert sizes == [1, 1]
    await batcher.close()
    executor.shutdown()


async def test_a_chain_of_batches_wakes_the_loop_once(engine: Doubler) -> None:
    """Batches that finish on the instance's thread before the loop looks share one wake-up
    (one call_soon_threadsafe, not one per batch), and are answered in order, once each."""
    clock, sizes = FakeClock(), []
    batcher, thread = make(engine, BatchPolicy(max_batch_size=1), clock, sizes)
    loop = asyncio.get_running_loop()
    wakeups: list[object] = []
    real = loop.call_soon_threadsafe

    def counting(callback: Any, *args: Any, **kwargs: Any) -> Any:
        wakeups.append(callback)
        return real(callback, *args, **kwargs)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        futures = [submit(batcher, x(i), received=clock.monotonic()) for i in range(4)]
        await asyncio.sleep(0)  # the pump hands the first batch over; the rest queue behind it
        # The loop is blocked here until the chain of four batches is over on the thread.
        assert thread.submit(lambda: None).result(timeout=5) is None
        assert engine.calls == [1, 1, 1, 1]
        assert len(wakeups) == 1
        outputs = await asyncio.gather(*futures)
    finally:
        loop.call_soon_threadsafe = real  # type: ignore[method-assign]
    assert [o["y"].item() for o, _ in outputs] == [0.0, 2.0, 4.0, 6.0]
    assert len(wakeups) == 1
    assert sizes == [1, 1, 1, 1]
    await batcher.close()
    thread.shutdown()


async def test_a_batch_for_a_shut_down_instance_thread_is_answered_with_an_error(engine: Doubler) -> None:
    clock = FakeClock()
    batcher, thread = make(engine, BatchPolicy(max_batch_size=1), clock, [])
    thread.shutdown()
    assert thread.join(5)
    with pytest.raises(InternalError, match="shut down"):
        await submit(batcher, x(1), received=clock.monotonic())
    assert engine.calls == []
    await batcher.close()


async def test_a_front_of_queue_request_runs_before_those_waiting(engine: Doubler) -> None:
    clock, order = FakeClock(), []
    batcher, executor = make(engine, BatchPolicy(max_batch_size=1), clock, [])
    futures = []
    for value, front in ((0, False), (1, False), (2, True)):  # one loop turn: all wait together
        future = submit(batcher, x(value), received=clock.monotonic(), front=front)
        future.add_done_callback(lambda f, v=value: order.append(v))
        futures.append(future)
    await asyncio.gather(*futures)
    assert order == [2, 0, 1]
    await batcher.close()
    executor.shutdown()


async def test_front_of_queue_requests_keep_their_order_among_themselves(engine: Doubler) -> None:
    clock, order = FakeClock(), []
    batcher, executor = make(engine, BatchPolicy(max_batch_size=1), clock, [])
    futures = []
    for value, front in ((0, False), (1, True), (2, False), (3, True)):
        future = submit(batcher, x(value), received=clock.monotonic(), front=front)
        future.add_done_callback(lambda f, v=value: order.append(v))
        futures.append(future)
    await asyncio.gather(*futures)
    assert order == [1, 3, 0, 2]
    await batcher.close()
    executor.shutdown()


async def test_a_burst_submitted_at_once_runs_as_one_batch(engine: Doubler) -> None:
    clock, sizes = FakeClock(), []
    batcher, executor = make(engine, BatchPolicy(max_batch_size=8), clock, sizes)
    burst = [submit(batcher, x(i), received=clock.monotonic()) for i in range(5)]  # no await between
    results = await asyncio.gather(*burst)
    assert engine.calls == [5] and sizes == [5]
    assert [r[0]["y"].item() for r in results] == [0.0, 2.0, 4.0, 6.0, 8.0]
    await batcher.close()
    executor.shutdown()


async def test_close_answers_queued_requests_and_refuses_new_ones(engine: Doubler) -> None:
    clock = FakeClock()
    batcher, executor = make(engine, BatchPolicy(max_batch_size=1), clock, [])
    engine.gate.clear()
    running = submit(batcher, x(1), received=clock.monotonic())
    await asyncio.sleep(0.05)
    queued = submit(batcher, x(2), received=clock.monotonic())
    closing = asyncio.create_task(batcher.close())
    await asyncio.sleep(0.05)
    assert not closing.done()  # waits for the running batch
    engine.gate.set()
    await closing
    assert (await running)[0]["y"].item() == 2.0
    with pytest.raises(InternalError, match="stopped"):
        await queued
    with pytest.raises(InternalError, match="stopped"):
        submit(batcher, x(3), received=clock.monotonic())
    assert engine.calls == [1]
    executor.shutdown()


async def test_a_failing_callback_does_not_cost_the_others_their_answer(engine: Doubler) -> None:
    clock = FakeClock()
    batcher, executor = make(engine, BatchPolicy(max_batch_size=4), clock, [])

    def broken(outcome: BatchOutcome) -> None:
        raise RuntimeError("caller bug")

    batcher.submit(x(1), deadline_unix_ns=0, received=clock.monotonic(), done=broken)
    other = submit(batcher, x(2), received=clock.monotonic())
    assert (await other)[0]["y"].item() == 4.0
    assert engine.calls == [2]
    await batcher.close()
    executor.shutdown()


async def test_a_waiting_batch_goes_once_a_request_cannot_join_it(engine: Doubler) -> None:
    """While a batch waits for company, a queued request it cannot stack with (another trailing
    shape) sends it off at once, and the rows counted while waiting start afresh after it."""
    clock, sizes = FakeClock(), []
    batcher, executor = make(engine, BatchPolicy(max_batch_size=4, max_queue_delay_ms=50), clock, sizes)
    first = [submit(batcher, x(i), received=clock.monotonic()) for i in range(2)]
    await asyncio.sleep(0.05)
    assert engine.calls == []  # two rows of four: waiting
    wide = submit(batcher, {"x": np.ones((1, 2), dtype=np.float32)}, received=clock.monotonic())
    results = await asyncio.gather(*first)
    assert engine.calls == [2]  # went without the clock moving
    assert results[0][1].batch_id == results[1][1].batch_id
    await asyncio.sleep(0.05)
    assert engine.calls == [2]  # the wide one waits for company of its own
    pair = [submit(batcher, {"x": np.ones((1, 2), dtype=np.float32)}, received=clock.monotonic())]
    pair.append(submit(batcher, {"x": np.ones((2, 2), dtype=np.float32)}, received=clock.monotonic()))
    wide_timing = (await wide)[1]
    assert engine.calls == [2, 4]  # 1 + 1 + 2 rows fill the batch: no wait
    assert [(await f)[1].batch_id for f in pair] == [wide_timing.batch_id] * 2
    assert wide_timing.batch_id != results[0][1].batch_id
    await batcher.close()
    executor.shutdown()
