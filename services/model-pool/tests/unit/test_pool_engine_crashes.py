"""An engine that reports a crash (`EngineContext.on_failure`, as an engine process does when
it exits): the pool unloads the model with the reason, releases its lease, and after
repeated crashes refuses the next load until the backoff has passed."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.common.config import ModelsSettings
from loadmaster.common.errors import UnavailableError
from loadmaster.model_pool.engines import Engine, EngineContext, engine_class
from loadmaster.model_pool.engines.python import PythonEngine
from loadmaster.model_pool.pool import ModelPool
from loadmaster.model_pool.repository import ModelRepository, ModelSpec
from loadmaster.model_pool.slots import ModelState

CONTEXTS: list[EngineContext] = []


class CrashingEngine(PythonEngine):
    """The example `double`, keeping its context so the test can report a crash through it."""

    def __init__(self, spec: ModelSpec, context: EngineContext) -> None:
        super().__init__(spec, context)
        CONTEXTS.append(context)


def engines(backend: str) -> type[Engine]:
    return CrashingEngine if backend == "python" else engine_class(backend)


@pytest.fixture
def repo(example_repo: Path, tmp_path: Path) -> Path:
    root = tmp_path / "models"
    shutil.copytree(example_repo / "double", root / "double")
    return root


async def _until_idle(pool: ModelPool) -> None:
    async with asyncio.timeout(10):
        while pool.status("double").state is not ModelState.IDLE:
            await asyncio.sleep(0.01)


async def test_crashes_unload_release_and_back_off(repo: Path, leases: Any) -> None:
    clock = FakeClock()
    pool = ModelPool(
        ModelRepository(repo),
        models=ModelsSettings(),
        lease_client=leases,
        clock=clock,
        engines=engines,
        load_retry_s=(2.0, 8.0),
    )
    CONTEXTS.clear()
    try:
        await pool.load("double")
        assert CONTEXTS[-1].gpus == (0,)  # the lease's GPUs reach the engine
        report = CONTEXTS[-1].on_failure
        assert report is not None
        await asyncio.to_thread(report, "engine process exited with status -9")  # from another thread
        await _until_idle(pool)
        status = pool.status("double")
        assert status.error == "engine failed: engine process exited with status -9"
        assert leases.held == set()  # released after the engine was unloaded

        await pool.load("double")  # the first crash reloads at once
        second = CONTEXTS[-1].on_failure
        assert second is not None
        report("stale: about the first load")  # a report about an earlier load is ignored
        await asyncio.sleep(0.05)
        assert pool.status("double").state is ModelState.READY
        second("engine process exited with status 1")
        await _until_idle(pool)
        assert "2 crashes, next load in 2.0s" in pool.status("double").error
        with pytest.raises(UnavailableError, match=r"next attempt in 2\.0s"):
            await pool.load("double")
        clock.advance(2.1)
        assert (await pool.load("double")).state is ModelState.READY
    finally:
        await pool.close()
