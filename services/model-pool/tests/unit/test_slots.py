from __future__ import annotations

import asyncio

import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.common.errors import UnavailableError
from loadmaster.model_pool.slots import ModelState, Slot, TransitionError
from loadmaster.model_pool.wire import STATE_TO_PB
from loadmaster.v1 import model_pool_pb2


def test_states_mirror_the_proto() -> None:
    names = {f"MODEL_STATE_{state.name}" for state in ModelState}
    proto = set(model_pool_pb2.ModelState.keys()) - {"MODEL_STATE_UNSPECIFIED"}
    assert names == proto
    assert all(model_pool_pb2.ModelState.Name(STATE_TO_PB[s]) == f"MODEL_STATE_{s.name}" for s in ModelState)


def test_full_cycle_and_generation() -> None:
    clock = FakeClock()
    slot = Slot("m", clock=clock, max_inflight=3, pinned=True, priority=0)
    assert slot.status().state is ModelState.IDLE and slot.generation == 0
    assert slot.begin_load() == 1
    slot.set_placement(backend="torch", device="cpu", vram_mb=64)
    slot.set_lease("lease-1")
    clock.advance(0.25)
    slot.loaded()
    status = slot.status()
    assert status.state is ModelState.READY
    assert status.load_time_ms == pytest.approx(250.0)
    assert status.loaded_unix_ms == int(clock.time() * 1000)
    assert (status.lease_id, status.backend, status.vram_mb, status.pinned, status.max_inflight) == (
        "lease-1",
        "torch",
        64,
        True,
        3,
    )
    slot.begin_drain()
    slot.begin_unload()
    slot.unloaded()
    assert slot.state is ModelState.IDLE and slot.lease_id == ""
    assert slot.begin_load() == 2  # one generation per load


def test_failed_load_is_idle_with_the_error() -> None:
    slot = Slot("m", clock=FakeClock())
    slot.begin_load()
    slot.set_lease("lease-1")
    slot.load_failed("artifact missing")
    status = slot.status()
    assert (status.state, status.error, status.lease_id) == (ModelState.IDLE, "artifact missing", "")
    with pytest.raises(UnavailableError, match="artifact missing") as caught:
        slot.acquire()
    assert caught.value.retryable
    slot.begin_load()
    assert slot.error == ""  # a new attempt clears it


@pytest.mark.parametrize(
    "steps",
    [
        ["loaded"],
        ["begin_drain"],
        ["begin_load", "begin_load"],
        ["begin_load", "begin_drain"],
        ["begin_load", "loaded", "begin_unload"],
        ["begin_load", "loaded", "unloaded"],
    ],
)
def test_out_of_order_steps_raise(steps: list[str]) -> None:
    slot = Slot("m", clock=FakeClock())
    *ok, bad = steps
    for step in ok:
        getattr(slot, step)()
    with pytest.raises(TransitionError):
        getattr(slot, bad)()


async def test_requests_only_when_ready_and_drain_waits_for_them() -> None:
    clock = FakeClock()
    slot = Slot("m", clock=clock)
    with pytest.raises(UnavailableError, match="'m' is idle"):
        slot.acquire()
    slot.begin_load()
    with pytest.raises(UnavailableError, match="loading"):
        slot.acquire()
    slot.loaded()
    assert slot.acquire() == 1
    assert slot.acquire() == 1
    assert slot.status().inflight == 2
    slot.begin_drain()
    with pytest.raises(UnavailableError, match="draining"):
        slot.acquire()
    with pytest.raises(TransitionError):
        slot.begin_unload()  # requests still in flight
    drained = asyncio.ensure_future(slot.drained())
    slot.release()
    await asyncio.sleep(0)
    assert not drained.done()
    clock.advance(1.0)
    slot.release()
    await asyncio.wait_for(drained, 1.0)
    assert slot.status().last_used_unix_ms == int(clock.time() * 1000)
    slot.begin_unload()
    assert slot.state is ModelState.UNLOADING
