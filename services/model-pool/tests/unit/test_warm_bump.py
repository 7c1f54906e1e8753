"""The warm bump in the pool (docs/vram-gate.md): a cold load that needs the memory of a model
in use waits for it, up to the bound, then drains and evicts it; a refusal for memory is not
held against the model's next load (the scheduler's VRAM gate paces those)."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.common.config import ModelSettings, ModelsSettings
from loadmaster.common.errors import ResourceExhaustedError, UnavailableError
from loadmaster.model_pool.pool import ModelPool
from loadmaster.model_pool.repository import ModelRepository
from loadmaster.model_pool.slots import ModelState

MODEL = """
import threading
import numpy as np

GATE = threading.Event()  # a request with hold=1 runs until the test opens it

class Held:
    def infer(self, inputs):
        if float(inputs["hold"].reshape(())):
            GATE.wait(10)
        return {"y": inputs["hold"]}
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    for name in ("warm", "cold"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text("backend: python\nclass: Held\nvram_mb: 600\n")
        (tmp_path / name / "model.py").write_text(MODEL)
    return tmp_path


def make(repo: Path, leases: Any, clock: FakeClock, *, bump_s: float) -> ModelPool:
    leases.capacity_mb = 1000  # one of the two 600 MB models fits
    return ModelPool(
        ModelRepository(repo),
        models=ModelsSettings(defaults=ModelSettings(min_resident_s=0.0)),
        lease_client=leases,
        lease_ttl_s=30.0,
        clock=clock,
        eviction_wait_s=1.0,
        warm_bump_s=(bump_s, 0.25),
    )


async def call(pool: ModelPool, model_id: str, *, hold: bool = False) -> Any:
    return await pool.infer(model_id, {"hold": np.array([1.0 if hold else 0.0], dtype=np.float32)})


async def turns(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def until_waiting(caplog: pytest.LogCaptureFixture) -> None:
    """Until the cold load waits in the room (its engine class is imported on a thread first)."""
    for _ in range(500):
        if "load of cold waits for warm" in caplog.text:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the cold load never waited for the warm model")


async def test_a_cold_load_waits_while_the_warm_model_is_in_use_then_evicts_it(
    repo: Path, leases: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="loadmaster.model_pool")
    clock = FakeClock()
    pool = make(repo, leases, clock, bump_s=5.0)
    await pool.load("warm")
    load = asyncio.create_task(pool.load("cold"))
    await until_waiting(caplog)
    for _ in range(10):  # a stream of requests for the warm model, 0.2 s apart: it stays
        await turns()
        assert pool.status("cold").state is ModelState.LOADING and not load.done()
        assert (await call(pool, "warm")).outputs["y"].tolist() == [0.0]
        clock.advance(0.2)
    await turns()
    assert pool.status("warm").state is ModelState.READY
    clock.advance(3.0)  # 5 s since the load began: the bound; the cold model goes in
    await asyncio.wait_for(load, 5)
    assert pool.status("warm").state is ModelState.IDLE and pool.status("cold").state is ModelState.READY
    assert "room for cold" in pool.status("warm").error
    await pool.close()


async def test_after_the_bound_a_busy_warm_model_is_drained_not_cut_off(
    repo: Path, leases: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="loadmaster.model_pool")
    clock = FakeClock()
    pool = make(repo, leases, clock, bump_s=5.0)
    await pool.load("warm")
    running = asyncio.create_task(call(pool, "warm", hold=True))
    await turns()
    load = asyncio.create_task(pool.load("cold"))
    await until_waiting(caplog)
    engine = pool._loaded["warm"].instances[0].engine  # the model's module holds its GATE
    clock.advance(5.0)
    for _ in range(50):
        await asyncio.sleep(0.01)
        if pool.status("warm").state is not ModelState.READY:
            break
    assert pool.status("warm").state is ModelState.DRAINING  # no new requests; the running one ends
    with pytest.raises(UnavailableError, match="draining"):
        await call(pool, "warm")
    assert pool.status("cold").state is ModelState.LOADING
    sys.modules[type(engine._model).__module__].GATE.set()
    assert (await asyncio.wait_for(running, 5)).outputs["y"].tolist() == [1.0]
    await asyncio.wait_for(load, 5)
    assert pool.status("cold").state is ModelState.READY
    await pool.close()


async def test_an_idle_warm_model_is_evicted_at_once(repo: Path, leases: Any) -> None:
    clock = FakeClock()
    pool = make(repo, leases, clock, bump_s=5.0)
    await pool.load("warm")
    await call(pool, "warm")
    clock.advance(0.3)  # its last request ended longer ago than the idle grace: not in use
    await asyncio.wait_for(pool.load("cold"), 5)
    assert pool.status("warm").state is ModelState.IDLE
    await pool.close()


async def test_a_refusal_for_memory_does_not_delay_the_next_attempt(repo: Path, leases: Any) -> None:
    clock = FakeClock()
    pool = make(repo, leases, clock, bump_s=0.0)
    leases.outside_mb = 500  # a training job holds half the card
    with pytest.raises(ResourceExhaustedError, match="no GPU memory for model 'cold'"):
        await pool.load("cold")
    leases.outside_mb = 0  # the job ended
    await pool.load("cold")  # at once: no "next attempt in ..." backoff for a memory refusal
    assert pool.status("cold").state is ModelState.READY
    await pool.close()
