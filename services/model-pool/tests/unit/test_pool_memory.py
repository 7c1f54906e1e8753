"""The pool making room: eviction on a full GPU, pinning, busy models, keep-alive, instances, batching."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.common.config import ModelSettings, ModelsSettings
from loadmaster.common.errors import ResourceExhaustedError
from loadmaster.model_pool.pool import ModelPool
from loadmaster.model_pool.repository import ModelRepository
from loadmaster.model_pool.slots import ModelState

SLOW = """
import time
import numpy as np

class Slow:
    def infer(self, inputs):
        time.sleep(float(inputs["ms"].reshape(())) / 1000.0)
        return {"ms": np.array(inputs["ms"])}
"""
SLOW_LOAD = """
import time
import numpy as np

class SlowLoad:
    def load(self):
        time.sleep(0.3)
    def infer(self, inputs):
        return {"ms": np.array(inputs["ms"])}
"""
BATCHED = """
import numpy as np

class Batched:
    calls = []
    def infer(self, inputs):
        Batched.calls.append(int(inputs["x"].shape[0]))
        return {"y": inputs["x"] * 3}
"""


@pytest.fixture
def repo(tmp_path: Path, example_repo: Path) -> Path:
    root = tmp_path / "models"
    root.mkdir()
    for name in ("a", "b", "c"):
        (root / name).mkdir()
        (root / name / "config.yaml").write_text("backend: python\nclass: Slow\nvram_mb: 400\n")
        (root / name / "model.py").write_text(SLOW)
    (root / "slow_load").mkdir()
    (root / "slow_load" / "config.yaml").write_text("backend: python\nclass: SlowLoad\nvram_mb: 400\n")
    (root / "slow_load" / "model.py").write_text(SLOW_LOAD)
    (root / "batched").mkdir()
    (root / "batched" / "config.yaml").write_text(
        "backend: python\nclass: Batched\nmax_batch_size: 8\ninstances: 2\n"
        "inputs: [{name: x, dtype: float32, shape: [-1, 2]}]\n"
    )
    (root / "batched" / "model.py").write_text(BATCHED)
    shutil.copytree(example_repo / "policy", root / "policy")
    return root


def make(
    repo: Path, leases: Any, *, clock: Any = None, wait_s: float = 0.0, **known: ModelSettings
) -> ModelPool:
    models = ModelsSettings(defaults=ModelSettings(min_resident_s=0.0), known=known)
    return ModelPool(
        ModelRepository(repo),
        models=models,
        lease_client=leases,
        lease_ttl_s=30.0,
        clock=clock,
        eviction_wait_s=wait_s,
    )


async def call(pool: ModelPool, model_id: str, ms: float = 0.0) -> Any:
    return await pool.infer(model_id, {"ms": np.array([ms], dtype=np.float32)})


async def test_a_full_gpu_evicts_the_least_recently_used(repo: Path, leases: Any) -> None:
    leases.capacity_mb = 1000
    pool = make(repo, leases)
    await pool.load("a")
    await pool.load("b")
    await call(pool, "a")  # b is now the least recently used
    await pool.load("c")
    states = {s.model_id: s.state for s in pool.statuses()}
    assert (states["a"], states["b"], states["c"]) == (ModelState.READY, ModelState.IDLE, ModelState.READY)
    assert pool.status("b").evictions == 1 and "evicted (capacity" in pool.status("b").error
    assert pool.counters.by_reason() == {"capacity": 1}
    await pool.load("b")  # evicts a now (LRU), and counts a reload
    assert pool.status("a").state is ModelState.IDLE
    assert pool.status("b").reloads == 1
    assert len(leases.held) == 2
    await pool.close()


async def test_nothing_is_evicted_when_evictions_could_not_make_room(repo: Path, leases: Any) -> None:
    """Another holder has 700 of the 1000 MB; a holds 200 of the 300 left. Evicting a would
    free 300 in all, short of the 400 that c needs: a stays and the load fails at once."""
    leases.capacity_mb, leases.outside_mb = 1000, 700
    clock = FakeClock()
    pool = make(repo, leases, clock=clock, a=ModelSettings(vram_mb=200))
    await pool.load("a")
    with pytest.raises(ResourceExhaustedError, match="evicting every evictable model would not make room"):
        await pool.load("c")
    assert pool.status("a").state is ModelState.READY and pool.status("a").evictions == 0
    assert pool.counters.by_reason() == {}
    leases.outside_mb = 500  # now evicting a (200) frees 500 of the 400 needed
    clock.advance(1.0)  # past the failed load's backoff
    await pool.load("c")
    assert pool.status("a").state is ModelState.IDLE and pool.status("c").state is ModelState.READY
    await pool.close()


async def test_a_load_evicts_as_many_models_as_it_needs_at_once(repo: Path, leases: Any) -> None:
    leases.capacity_mb = 1000
    pool = make(
        repo, leases, a=ModelSettings(vram_mb=300), b=ModelSettings(vram_mb=300), c=ModelSettings(vram_mb=900)
    )
    await pool.load("a")
    await pool.load("b")
    await pool.load("c")
    states = {s.model_id: s.state for s in pool.statuses()}
    assert (states["a"], states["b"], states["c"]) == (ModelState.IDLE, ModelState.IDLE, ModelState.READY)
    await pool.close()


async def test_pinned_and_busy_models_are_never_evicted(repo: Path, leases: Any) -> None:
    leases.capacity_mb = 1000
    pool = make(repo, leases)
    await pool.load("a")
    await pool.load("b")
    pool.pin("a")
    busy = asyncio.create_task(call(pool, "b", ms=300))
    await asyncio.sleep(0.05)
    with pytest.raises(ResourceExhaustedError, match=r"a \(pinned\), b \(busy\)"):
        await pool.load("c")
    assert pool.status("c").state is ModelState.IDLE
    assert "nothing can be evicted" in pool.status("c").error
    await busy
    assert pool.status("a").state is pool.status("b").state is ModelState.READY
    assert pool.counters.by_reason() == {}
    await pool.close()


async def test_a_load_waits_for_a_busy_model_then_evicts_it(repo: Path, leases: Any) -> None:
    leases.capacity_mb = 1000
    pool = make(repo, leases, wait_s=10.0)
    await pool.load("a")
    await pool.load("b")
    pool.pin("a")
    busy = asyncio.create_task(call(pool, "b", ms=200))
    await asyncio.sleep(0.05)
    await pool.load("c")  # waits for b's request, then evicts b
    assert (await busy).outputs["ms"].tolist() == [200.0]  # answered, not cut off
    assert pool.status("b").state is ModelState.IDLE and pool.status("c").state is ModelState.READY
    await pool.close()


async def pinned_a_and_slow_load_mid_load(pool: ModelPool) -> asyncio.Task[Any]:
    """`a` READY and pinned; `slow_load` holding its lease, still LOADING (its load task)."""
    await pool.load("a")
    pool.pin("a")
    loading = asyncio.create_task(pool.load("slow_load"))
    for _ in range(100):  # bounded: until slow_load holds its lease
        if pool.status("slow_load").lease_id:
            break
        await asyncio.sleep(0.01)
    assert pool.status("slow_load").state is ModelState.LOADING
    return loading


async def test_a_load_waits_for_a_model_still_loading_then_evicts_it(repo: Path, leases: Any) -> None:
    # The race CI once hit: slow_load holds its lease but is not READY yet when c needs room.
    # c must wait for it to settle (and then evict it), not fail with "only a (pinned)".
    leases.capacity_mb = 1000
    pool = make(repo, leases, wait_s=10.0)
    loading = await pinned_a_and_slow_load_mid_load(pool)
    await pool.load("c")
    await loading
    states = {s.model_id: s.state for s in pool.statuses()}
    assert (states["a"], states["slow_load"], states["c"]) == (
        ModelState.READY,
        ModelState.IDLE,
        ModelState.READY,
    )
    assert pool.status("slow_load").evictions == 1
    await pool.close()


async def test_a_load_with_no_wait_fails_at_once_naming_the_loading_model(repo: Path, leases: Any) -> None:
    leases.capacity_mb = 1000
    pool = make(repo, leases, wait_s=0.0)
    loading = await pinned_a_and_slow_load_mid_load(pool)
    with pytest.raises(ResourceExhaustedError, match=r"a \(pinned\), slow_load \(loading\)"):
        await pool.load("c")
    await loading
    await pool.close()


async def test_higher_priority_models_stay(repo: Path, leases: Any) -> None:
    leases.capacity_mb = 500
    pool = make(repo, leases, a=ModelSettings(priority=5), c=ModelSettings(priority=1))
    await pool.load("a")
    with pytest.raises(ResourceExhaustedError, match=r"priority 5 > 1"):
        await pool.load("c")
    await pool.close()


async def test_min_resident_s_holds_a_young_model_until_it_comes_of_age(repo: Path, leases: Any) -> None:
    leases.capacity_mb = 500
    clock = FakeClock()
    pool = make(repo, leases, clock=clock, wait_s=60.0, a=ModelSettings(min_resident_s=5.0))
    await pool.load("a")
    loading = asyncio.create_task(pool.load("c"))
    for _ in range(20):
        await asyncio.sleep(0.01)
    assert not loading.done() and pool.status("a").state is ModelState.READY
    clock.advance(5.0)
    await asyncio.wait_for(loading, 5)
    assert pool.status("a").state is ModelState.IDLE and pool.status("c").state is ModelState.READY
    await pool.close()


async def test_keep_alive_unloads_idle_models(repo: Path, leases: Any) -> None:
    clock = FakeClock()
    pool = make(repo, leases, clock=clock, a=ModelSettings(keep_alive_s=30.0))
    await pool.load("a")
    await pool.load("b")  # no keep_alive_s: stays
    clock.advance(29.0)
    await asyncio.sleep(0.05)
    assert pool.status("a").state is ModelState.READY
    clock.advance(1.0)
    for _ in range(50):
        await asyncio.sleep(0.01)
        if pool.status("a").state is ModelState.IDLE:
            break
    assert pool.status("a").state is ModelState.IDLE
    assert pool.status("b").state is ModelState.READY
    assert pool.counters.by_reason() == {"idle": 1}
    await pool.close()


async def test_free_mb_counts_what_could_be_freed(repo: Path, leases: Any) -> None:
    pool = make(repo, leases)
    await pool.load("a")
    await pool.load("b")
    assert pool.free_mb() == 800
    pool.pin("b")
    assert pool.free_mb() == 400
    assert pool.leased_mb_per_gpu() == {0: 800}
    await pool.close()


async def test_batched_model_with_instances(repo: Path, leases: Any) -> None:
    pool = make(repo, leases)
    status = await pool.load("batched")
    assert (status.instances, status.max_batch_size) == (2, 8)
    inputs = [{"x": np.full((1, 2), i, dtype=np.float32)} for i in range(16)]
    results = await asyncio.gather(*(pool.infer("batched", x) for x in inputs))
    for i, result in enumerate(results):
        assert result.outputs["y"].tolist() == [[3.0 * i, 3.0 * i]]
    assert max(r.batch_size for r in results) > 1
    await pool.close()


async def test_policy_batches_and_matches_its_reference(repo: Path, leases: Any) -> None:
    pool = make(repo, leases)
    await pool.load("policy")
    reference = np.load(repo / "policy" / "artifacts" / "reference.npz")
    state, action = reference["input.state"], reference["output.action"]
    results = await asyncio.gather(*(pool.infer("policy", {"state": state[i : i + 1]}) for i in range(4)))
    got = np.concatenate([r.outputs["action"] for r in results])
    np.testing.assert_allclose(got, action, rtol=1e-4, atol=1e-5)
    await pool.close()
