"""Memory used outside leases from NVML samples (pure), and the NVML wrapper on a fake pynvml."""

from __future__ import annotations

import types
from pathlib import Path

from loadmaster.gpu_broker.leases import Lease
from loadmaster.gpu_broker.nvml import NvmlSampler, proc_ancestors
from loadmaster.gpu_broker.reconcile import GpuSample, outside_lease_mb

NOW = 1_000_000


def lease(pid: int | None, mb: int, *, expires: int = NOW + 30_000, index: int = 0, node: str = "n") -> Lease:
    labels = {} if pid is None else {"pid": str(pid)}
    return Lease(f"l{pid}-{mb}", "h", node, {index: mb}, labels, 0, expires, 1)


def outside(sample: GpuSample, leases: list[Lease], parents: dict[int, int] | None = None) -> int:
    parents = parents or {}

    def ancestors(pid: int) -> list[int]:
        chain = []
        while pid in parents:
            pid = parents[pid]
            chain.append(pid)
        return chain

    return outside_lease_mb(
        sample, leases=leases, node="n", reserve_mb=500, now_ms=NOW, horizon_ms=3_000, ancestors=ancestors
    )


def test_a_holder_within_its_lease_uses_nothing_outside() -> None:
    assert outside(GpuSample(0, used_mb=500 + 3_000, processes={10: 3_000}), [lease(10, 4_000)]) == 0


def test_use_beyond_the_lease_and_unleased_processes_are_outside() -> None:
    sample = GpuSample(0, used_mb=500 + 5_000 + 700, processes={10: 5_000, 11: 700})
    assert outside(sample, [lease(10, 4_000)]) == 1_000 + 700


def test_a_dead_holders_bytes_still_in_use_stay_unavailable() -> None:
    sample = GpuSample(0, used_mb=500 + 3_000, processes={10: 3_000})
    assert outside(sample, []) == 3_000  # lease reaped, process alive
    assert outside(sample, [lease(10, 4_000, expires=NOW + 2_000)]) == 3_000  # expiring within the horizon
    assert outside(sample, [lease(10, 4_000, expires=NOW - 1)]) == 3_000  # expired, not reaped yet


def test_children_of_the_holder_are_covered_by_its_lease() -> None:
    sample = GpuSample(0, used_mb=500 + 2_500, processes={21: 1_000, 22: 1_500})
    assert outside(sample, [lease(20, 2_000)], parents={21: 20, 22: 21}) == 500  # shared coverage


def test_memory_no_visible_process_explains_is_outside_beyond_unseen_holders() -> None:
    # 1000 MB unattributed (beyond the reserve); an unseen holder (another PID namespace) leases 600.
    sample = GpuSample(0, used_mb=500 + 1_000, processes={})
    assert outside(sample, [lease(99, 600)]) == 400
    assert outside(sample, [lease(None, 1_500)]) == 0
    assert outside(sample, [lease(99, 600, index=1)]) == 1_000  # a lease on another GPU explains nothing
    assert outside(sample, [lease(99, 600, node="other")]) == 1_000


def test_nvml_sampler_reads_memory_and_processes_in_mb() -> None:
    mb = 1 << 20
    handles = {0: "h0", 1: "h1"}
    fake = types.SimpleNamespace(
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=(1_234 if h == "h0" else 10) * mb),
        nvmlDeviceGetComputeRunningProcesses=lambda h: (
            [
                types.SimpleNamespace(pid=7, usedGpuMemory=700 * mb),
                types.SimpleNamespace(pid=8, usedGpuMemory=None),
            ]
            if h == "h0"
            else []
        ),
        nvmlDeviceGetGraphicsRunningProcesses=lambda h: (
            [types.SimpleNamespace(pid=7, usedGpuMemory=100 * mb)] if h == "h0" else []
        ),
        nvmlShutdown=lambda: None,
    )
    samples = NvmlSampler(fake, handles).sample()
    assert samples == [GpuSample(0, 1_234, {7: 800, 8: 0}), GpuSample(1, 10, {})]


def test_proc_ancestors_reads_the_parent_chain(tmp_path: Path) -> None:
    for pid, ppid, comm in ((30, 20, "a b) (c"), (20, 10, "sh"), (10, 1, "init-ish")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) S {ppid} 1 1 0 -1\n")
    assert proc_ancestors(30, proc=tmp_path) == [20, 10]
    assert proc_ancestors(99, proc=tmp_path) == []
