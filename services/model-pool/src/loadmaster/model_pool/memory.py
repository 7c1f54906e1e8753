"""Is device memory really free? NVML's view of this process, for releasing leases safely.

The pool releases a model's lease only after its engines unloaded (CUDA caches
emptied). On NVIDIA it also asks NVML how much memory this process holds on each
GPU of the lease and waits (bounded) until it is back near what it held before the
load. NVML (`pynvml`, from `nvidia-ml-py`) is optional: without it, or for CPU
devices, `process_used_mb` answers None and the engines' own cleanup is trusted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Collection, Iterable, Mapping

from loadmaster.common.clock import Clock

__all__ = ["freed", "process_used_mb", "processes_used_mb", "snapshot", "wait_freed", "wait_processes_gone"]

log = logging.getLogger(__name__)


def process_used_mb(gpu: int) -> int | None:
    """MB this process holds on `gpu` according to NVML; None when NVML cannot say."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
        used = 0
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == os.getpid() and process.usedGpuMemory is not None:
                used += int(process.usedGpuMemory)
        return used >> 20
    except Exception as error:
        log.debug("NVML could not read GPU %d: %s", gpu, error)
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def snapshot(gpus: Iterable[int]) -> dict[int, int]:
    """This process's MB per GPU, for the GPUs NVML can read."""
    out: dict[int, int] = {}
    for gpu in gpus:
        used = process_used_mb(gpu)
        if used is not None:
            out[gpu] = used
    return out


def freed(before: dict[int, int], after: dict[int, int], *, tolerance_mb: int) -> bool:
    """True when no GPU holds more than `tolerance_mb` above what it held before the load."""
    return all(after.get(gpu, used) <= used + tolerance_mb for gpu, used in before.items())


async def wait_freed(
    before: dict[int, int], leased: Mapping[int, int], *, clock: Clock, checks: int = 10, every_s: float = 0.1
) -> bool:
    """Wait (at most `checks` x `every_s`) until NVML shows this process back near `before`.

    Tolerance: 64 MB or 5% of the lease on that GPU (allocator slack, CUDA context growth).
    """
    tolerance = max([64, *(mb // 20 for mb in leased.values())])
    for _ in range(checks):
        after = await asyncio.to_thread(snapshot, before)
        if freed(before, after, tolerance_mb=tolerance):
            return True
        await clock.sleep(every_s)
    return False


def processes_used_mb(gpus: Iterable[int], pids: Collection[int]) -> tuple[int, int] | None:
    """(how many of `pids` NVML lists on `gpus`, the MB they hold there): an engine process
    and its children. None when NVML cannot say (no pynvml, no NVIDIA driver)."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        listed = used = 0
        for gpu in gpus:
            handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid in pids:
                    listed += 1
                    used += int(process.usedGpuMemory or 0)
        return listed, used >> 20
    except Exception as error:
        log.debug("NVML could not read GPUs %s: %s", list(gpus), error)
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def wait_processes_gone(
    gpus: Collection[int], pids: Collection[int], *, timeout_s: float, every_s: float = 0.1
) -> bool:
    """Block (an engine's unload runs on its own thread) until NVML lists none of `pids` on
    `gpus`, at most `timeout_s`. True at once where NVML cannot say (CPU, no driver)."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = processes_used_mb(gpus, pids)
        if seen is None or seen[0] == 0:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(every_s)
