from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.common.config import ModelSettings, ModelsSettings
from loadmaster.common.errors import (
    ExpiredError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from loadmaster.model_pool.leases import Lease
from loadmaster.model_pool.pool import ModelPool, device_for_lease, gpus_for_device
from loadmaster.model_pool.repository import ModelConfigError, ModelRepository
from loadmaster.model_pool.slots import ModelState, SlotStatus

COUNTER = """
from pathlib import Path
import numpy as np

class Counter:
    def infer(self, inputs):
        with open(Path(__file__).parent / "calls.txt", "a") as f:
            f.write("x")
        return {"n": np.array([1], dtype=np.int32)}
"""
BOOM = """
class Boom:
    def infer(self, inputs):
        raise ValueError("boom: bad weights")
"""
FAILS_TO_LOAD = """
class Broken:
    def load(self):
        raise RuntimeError("weights corrupt")
    def infer(self, inputs):
        return {}
"""
SLOW_LOAD = """
import time
import numpy as np
class SlowLoad:
    def load(self):
        time.sleep(0.8)
    def infer(self, inputs):
        return {"x": np.array([1.0], dtype=np.float32)}
"""
BAD_OUTPUT = """
import numpy as np
class BadOutput:
    def infer(self, inputs):
        return {"z": np.array([1 + 2j], dtype=np.complex64)}
"""


class Recorder:
    def __init__(self) -> None:
        self.samples: list[tuple[str, float, dict[str, str]]] = []

    def record(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        self.samples.append((name, value, dict(labels or {})))


@pytest.fixture
def repo(example_repo: Path, tmp_path: Path) -> Path:
    root = tmp_path / "models"
    shutil.copytree(example_repo, root, ignore=shutil.ignore_patterns("__pycache__"))
    for model_id, cls, code in [
        ("counter", "Counter", COUNTER),
        ("boom", "Boom", BOOM),
        ("broken", "Broken", FAILS_TO_LOAD),
        ("bad_output", "BadOutput", BAD_OUTPUT),
        ("slow_load", "SlowLoad", SLOW_LOAD),
    ]:
        (root / model_id).mkdir()
        (root / model_id / "config.yaml").write_text(f"backend: python\nclass: {cls}\n")
        (root / model_id / "model.py").write_text(code)
    (root / "bad_config").mkdir()
    (root / "bad_config" / "config.yaml").write_text("backend: python\n")
    return root


def make_pool(
    repo: Path,
    leases: Any,
    *,
    clock: Any = None,
    known: dict[str, ModelSettings] | None = None,
    metrics: Any = None,
) -> ModelPool:
    return ModelPool(
        ModelRepository(repo),
        models=ModelsSettings(known=known or {}),
        lease_client=leases,
        lease_ttl_s=3.0,
        clock=clock,
        metrics=metrics,
    )


def test_device_helpers() -> None:
    assert gpus_for_device("cuda:2") == [2]
    assert gpus_for_device("cuda") == [] and gpus_for_device("cpu") == []
    assert device_for_lease("cuda", Lease("l", 1, {3: 100})) == "cuda:3"
    assert device_for_lease("cuda:1", Lease("l", 1, {3: 100})) == "cuda:1"
    assert device_for_lease("cpu", Lease("l", 1, {0: 100})) == "cpu"


async def test_load_infer_unload_and_generation(repo: Path, leases: Any) -> None:
    metrics = Recorder()
    pool = make_pool(repo, leases, metrics=metrics)
    assert {s.model_id: s.state for s in pool.statuses()}["double"] is ModelState.IDLE
    status = await pool.load("double")
    assert (status.state, status.generation, status.backend, status.device) == (
        ModelState.READY,
        1,
        "python",
        "cpu",
    )
    assert leases.acquired == [
        {
            "lease_id": "lease-1",
            "mb": 16,
            "ttl_s": 3.0,
            "labels": {"model": "double"},
            "gpus": [],
            "allow_split": False,
        }
    ]
    assert status.lease_id == "lease-1"
    x = np.arange(4, dtype=np.float32)
    result = await pool.infer("double", {"x": x})
    assert (result.outputs["x"] == x * 2).all() and result.generation == 1 and result.batch_size == 1
    assert result.inference_ms >= 0 and result.queue_ms >= 0
    status = await pool.unload("double")
    assert status.state is ModelState.IDLE
    assert leases.released == ["lease-1"]
    assert (await pool.load("double")).generation == 2
    await pool.close()
    assert leases.held == set()
    names = {name for name, _, _ in metrics.samples}
    assert {"slot_state", "model_load_ms", "inference_latency_ms", "batch_size"} <= names
    ready = [s for s in metrics.samples if s[0] == "slot_state" and s[2]["state"] == "ready"]
    assert [value for _, value, _ in ready] == [1.0, 0.0, 1.0, 0.0]


async def test_lease_size_precedence(repo: Path, leases: Any) -> None:
    pool = make_pool(repo, leases, known={"double": ModelSettings(vram_mb=500)})
    await pool.load("double")  # deployment setting beats config.yaml's 16
    await pool.load("policy")  # config.yaml: 64
    await pool.load("counter")  # neither: folder size x 1.3, at least 1
    assert [a["mb"] for a in leases.acquired] == [500, 64, 1]
    assert pool.status("policy").vram_mb == 64
    await pool.close()


async def test_broken_config_fails_that_model_only(repo: Path, leases: Any) -> None:
    pool = make_pool(repo, leases)
    with pytest.raises(ModelConfigError, match="class: Field required"):
        await pool.load("bad_config")
    status = pool.status("bad_config")
    assert status.state is ModelState.IDLE and "class: Field required" in status.error
    assert leases.acquired == []
    assert (await pool.load("double")).state is ModelState.READY
    await pool.close()


async def test_engine_load_error_frees_the_lease(repo: Path, leases: Any) -> None:
    pool = make_pool(repo, leases)
    with pytest.raises(InternalError, match="weights corrupt"):
        await pool.load("broken")
    status = pool.status("broken")
    assert status.state is ModelState.IDLE and "RuntimeError: weights corrupt" in status.error
    assert status.lease_id == ""
    assert leases.released == ["lease-1"]
    with pytest.raises(UnavailableError, match="weights corrupt"):
        await pool.infer("broken", {})
    await pool.close()


async def test_unreachable_broker_fails_the_load_unavailable(repo: Path, unreachable_broker: Any) -> None:
    pool = make_pool(repo, unreachable_broker)
    with pytest.raises(UnavailableError, match="unreachable"):
        await pool.load("double")
    status = pool.status("double")
    assert status.state is ModelState.IDLE and "unreachable" in status.error
    await pool.close()


async def test_concurrent_loads_share_one(repo: Path, leases: Any) -> None:
    pool = make_pool(repo, leases)
    statuses = await asyncio.gather(*(pool.load("policy") for _ in range(3)))
    assert {s.generation for s in statuses} == {1}
    assert len(leases.acquired) == 1
    await pool.close()


async def test_unknown_and_not_ready_models(repo: Path, leases: Any) -> None:
    pool = make_pool(repo, leases)
    with pytest.raises(NotFoundError):
        await pool.load("nope")
    with pytest.raises(NotFoundError):
        await pool.infer("nope", {})
    with pytest.raises(UnavailableError, match="'double' is idle") as caught:
        await pool.infer("double", {})
    assert caught.value.retryable
    await pool.close()


async def test_unload_drains_in_flight_requests(repo: Path, leases: Any) -> None:
    pool = make_pool(repo, leases)
    await pool.load("sleep")
    seen: list[ModelState] = []
    pool.add_listener(lambda status: seen.append(status.state))
    request = asyncio.create_task(pool.infer("sleep", {"ms": np.array([150], np.float32)}))
    await asyncio.sleep(0.02)
    assert pool.status("sleep").inflight == 1
    unload = asyncio.create_task(pool.unload("sleep"))
    await asyncio.sleep(0.02)
    assert pool.status("sleep").state is ModelState.DRAINING
    with pytest.raises(UnavailableError, match="draining"):
        await pool.infer("sleep", {"ms": np.array([0], np.float32)})
    assert leases.released == []
    result = await request
    assert "ms" in result.outputs
    await unload
    assert seen == [ModelState.DRAINING, ModelState.UNLOADING, ModelState.IDLE]
    assert leases.released == ["lease-1"]
    await pool.close()


async def test_slow_model_does_not_block_another(repo: Path, leases: Any) -> None:
    pool = make_pool(repo, leases)
    await asyncio.gather(pool.load("sleep"), pool.load("double"))
    slow = asyncio.create_task(pool.infer("sleep", {"ms": np.array([600], np.float32)}))
    await asyncio.sleep(0.02)
    started = time.monotonic()
    await pool.infer("double", {"x": np.ones(2, np.float32)})
    assert time.monotonic() - started < 0.4
    assert not slow.done()  # double finished while sleep was still running
    await slow
    await pool.close()


async def test_expired_requests_never_run(repo: Path, leases: Any) -> None:
    clock = FakeClock()
    pool = make_pool(repo, leases, clock=clock)
    await pool.load("counter")
    now_ns = int(clock.time() * 1e9)
    with pytest.raises(ExpiredError):
        await pool.infer("counter", {}, deadline_unix_ns=now_ns - 1)
    assert not (repo / "counter" / "calls.txt").exists()
    result = await pool.infer("counter", {}, deadline_unix_ns=now_ns + 1_000_000_000)
    assert result.outputs["n"].tolist() == [1]
    assert (repo / "counter" / "calls.txt").read_text() == "x"
    await pool.close()


async def test_request_expiring_in_the_model_queue_is_not_run(repo: Path, leases: Any) -> None:
    pool = make_pool(repo, leases)
    await pool.load("sleep")
    slow = asyncio.create_task(pool.infer("sleep", {"ms": np.array([200], np.float32)}))
    await asyncio.sleep(0.02)
    deadline = time.time_ns() + 50_000_000  # 50 ms: passes while the slow one runs
    with pytest.raises(ExpiredError, match="in the model's queue"):
        await pool.infer("sleep", {"ms": np.array([0], np.float32)}, deadline_unix_ns=deadline)
    await slow
    await pool.close()


async def test_model_errors(repo: Path, leases: Any) -> None:
    pool = make_pool(repo, leases)
    await asyncio.gather(*(pool.load(m) for m in ("boom", "sleep", "bad_output", "policy")))
    with pytest.raises(InternalError, match="ValueError: boom: bad weights"):
        await pool.infer("boom", {})
    with pytest.raises(InvalidArgumentError, match="one value expected"):  # raised by the model itself
        await pool.infer("sleep", {"ms": np.zeros(2, np.float32)})
    with pytest.raises(InternalError, match="cannot travel on the wire"):
        await pool.infer("bad_output", {})
    with pytest.raises(InvalidArgumentError, match="tensor 'state': shape"):
        await pool.infer("policy", {"state": np.zeros((2, 31), np.float32)})
    assert all(s.inflight == 0 for s in pool.statuses())
    out = await pool.infer("policy", {"state": np.zeros((2, 32), np.float32)})
    assert out.outputs["action"].shape == (2, 8)
    await pool.close()


async def _until(condition: Any, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


def short_lease_pool(repo: Path, leases: Any) -> ModelPool:
    """Leases of 0.5 s: the keeper's thread (real time) renews every 0.1 s."""
    return ModelPool(ModelRepository(repo), models=ModelsSettings(), lease_client=leases, lease_ttl_s=0.5)


async def test_leases_are_renewed_and_a_lost_lease_that_cannot_be_had_again_unloads(
    repo: Path, leases: Any
) -> None:
    pool = short_lease_pool(repo, leases)
    await pool.load("double")
    await _until(lambda: leases.renewed.count("lease-1") >= 2)
    idle = asyncio.Event()
    pool.add_listener(lambda s: idle.set() if s.state is ModelState.IDLE else None)
    leases.fail_acquire = ResourceExhaustedError("taken meanwhile")
    leases.lost.add("lease-1")
    await asyncio.wait_for(idle.wait(), 5.0)
    status = pool.status("double")
    assert status.state is ModelState.IDLE and "lease-1 lost" in status.error, status.error
    with pytest.raises(UnavailableError):
        await pool.infer("double", {"x": np.ones(1, np.float32)})
    await pool.close()


async def test_a_lease_the_broker_lost_is_acquired_again_and_the_model_stays(repo: Path, leases: Any) -> None:
    pool = short_lease_pool(repo, leases)
    await pool.load("double")
    leases.lost.add("lease-1")  # e.g. its Redis lost its data
    await _until(lambda: pool.status("double").lease_id == "lease-2")
    assert pool.status("double").state is ModelState.READY
    assert leases.acquired[1]["mb"] == leases.acquired[0]["mb"]
    assert leases.acquired[1]["labels"]["model"] == "double"
    result = await pool.infer("double", {"x": np.ones(1, np.float32)})
    assert result.outputs["x"].tolist() == [2.0]
    await _until(lambda: "lease-2" in leases.renewed)
    await pool.close()
    assert leases.released == ["lease-2"]


async def test_a_lease_lost_while_its_model_loads_fails_the_load(repo: Path, leases: Any) -> None:
    """The lease is kept from its grant on: lost during a 0.8 s load (and not to be had again),
    the load fails instead of serving a model whose memory is not leased."""
    pool = short_lease_pool(repo, leases)
    loading = asyncio.create_task(pool.load("slow_load"))
    await _until(lambda: leases.acquired)
    leases.fail_acquire = ResourceExhaustedError("taken meanwhile")
    leases.lost.add("lease-1")
    with pytest.raises(UnavailableError, match="lost while it loaded"):
        await loading
    assert pool.status("slow_load").state is ModelState.IDLE
    assert leases.released == ["lease-1"]
    await pool.close()


async def test_a_lease_past_the_holders_deadline_is_not_used(repo: Path, leases: Any) -> None:
    """Renewals that never succeed: the model stops being served (and is unloaded) before
    the broker could re-grant its memory."""
    pool = short_lease_pool(repo, leases)
    await pool.load("double")

    async def unreachable(lease: Lease, *, ttl_s: float) -> Lease:
        raise UnavailableError("gpu-broker unreachable")

    leases.renew = unreachable
    idle = asyncio.Event()
    pool.add_listener(lambda s: idle.set() if s.state is ModelState.IDLE else None)
    await asyncio.wait_for(idle.wait(), 5.0)
    assert "no renewal succeeded" in pool.status("double").error
    await pool.close()


async def test_close_unloads_everything_and_refuses_work(repo: Path, leases: Any) -> None:
    pool = make_pool(repo, leases)
    await asyncio.gather(pool.load("double"), pool.load("policy"))
    loading = asyncio.create_task(pool.load("sleep"))
    await asyncio.sleep(0)
    statuses: list[SlotStatus] = []
    pool.add_listener(statuses.append)
    await pool.close()
    await asyncio.gather(loading, return_exceptions=True)
    assert all(s.state is ModelState.IDLE for s in pool.statuses())
    assert leases.held == set() and len(leases.acquired) == 3
    with pytest.raises(UnavailableError, match="shutting down"):
        await pool.infer("double", {})
    with pytest.raises(UnavailableError, match="shutting down"):
        await pool.load("double")
