"""`NvmlSampler`: every NVML call the reconciliation makes (pynvml, from nvidia-ml-py).

`NvmlSampler.open()` returns None when pynvml is not installed or finds no GPU, so the
broker then runs on its declared inventory with nothing to reconcile. Untested on a real
GPU here (none on our machines); the decisions it feeds are in `reconcile.py`, unit-tested.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from loadmaster.gpu_broker.reconcile import GpuSample

__all__ = ["NvmlSampler", "proc_ancestors"]

log = logging.getLogger(__name__)

_MB = 1 << 20


class NvmlSampler:
    def __init__(self, pynvml: Any, handles: dict[int, Any]) -> None:
        self._nvml = pynvml
        self._handles = handles

    @classmethod
    def open(cls) -> NvmlSampler | None:
        try:
            import pynvml  # type: ignore[import-not-found]
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            handles = {index: pynvml.nvmlDeviceGetHandleByIndex(index) for index in range(count)}
        except Exception as error:  # pynvml.NVMLError: no driver, no GPU
            log.info("NVML unavailable for reconciliation (%s)", error)
            return None
        return cls(pynvml, handles) if handles else None

    def sample(self) -> list[GpuSample]:
        """Memory used per GPU and per visible process (processes NVML cannot size count 0)."""
        samples = []
        for index, handle in sorted(self._handles.items()):
            memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            processes: dict[int, int] = {}
            for query in (
                self._nvml.nvmlDeviceGetComputeRunningProcesses,
                self._nvml.nvmlDeviceGetGraphicsRunningProcesses,
            ):
                for process in query(handle):
                    used = getattr(process, "usedGpuMemory", None)  # None: not available (e.g. Windows WDDM)
                    processes[int(process.pid)] = processes.get(int(process.pid), 0) + (
                        int(used) // _MB if used else 0
                    )
            samples.append(GpuSample(index=index, used_mb=int(memory.used) // _MB, processes=processes))
        return samples

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            log.debug("nvmlShutdown failed", exc_info=True)


def proc_ancestors(pid: int, *, proc: Path = Path("/proc"), limit: int = 64) -> list[int]:
    """Parent, grandparent, … of `pid` from /proc (stops at pid 1 or an unreadable entry)."""
    chain: list[int] = []
    current = pid
    for _ in range(limit):
        try:
            stat = (proc / str(current) / "stat").read_text()
        except OSError:
            break
        # "pid (comm) state ppid …": comm may contain spaces or parentheses; split after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        parent = int(fields[1]) if len(fields) > 1 else 0
        if parent <= 1:
            break
        chain.append(parent)
        current = parent
    return chain
