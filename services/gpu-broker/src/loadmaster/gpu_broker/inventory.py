"""The GPUs this broker registers at start: NVML's when available, else the declared ones.

NVML (`pynvml`, from the `nvidia-ml-py` package) is optional: it is used only when
`use_nvml` is true, the module imports, and it finds at least one GPU. Otherwise the
inventory is `settings.gpu_broker.declared` (node -> GPUs with total_mb). Either way
each GPU gets the broker's `reserve_mb`.
"""

from __future__ import annotations

import logging
from typing import Any

from loadmaster.common.config import GpuBrokerSettings
from loadmaster.gpu_broker.leases import GpuState

__all__ = ["declared_inventory", "local_inventory", "nvml_inventory"]

log = logging.getLogger(__name__)

_MB = 1 << 20


def declared_inventory(settings: GpuBrokerSettings) -> dict[str, list[GpuState]]:
    return {
        node: [
            GpuState(
                node=node,
                index=spec.index,
                total_mb=spec.total_mb,
                reserve_mb=settings.reserve_mb,
                name=spec.name,
                uuid=spec.uuid,
            )
            for spec in specs
        ]
        for node, specs in settings.declared.items()
    }


def nvml_inventory(node: str, *, reserve_mb: int) -> list[GpuState]:
    """This host's NVIDIA GPUs, or [] when NVML is not installed or finds none.

    Memory in use at registration is not counted as `used_outside_mb`: on a broker
    restart it would include memory that live leases already account for.
    """
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        log.info("NVML not installed (package nvidia-ml-py); using the declared inventory")
        return []
    try:
        pynvml.nvmlInit()
    except Exception as error:  # pynvml.NVMLError: no driver, no GPU
        log.info("NVML unavailable (%s); using the declared inventory", error)
        return []
    try:
        return [_nvml_gpu(pynvml, node, index, reserve_mb) for index in range(pynvml.nvmlDeviceGetCount())]
    except Exception:
        log.exception("NVML query failed; using the declared inventory")
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            log.debug("nvmlShutdown failed", exc_info=True)


def _nvml_gpu(pynvml: Any, node: str, index: int, reserve_mb: int) -> GpuState:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return GpuState(
        node=node,
        index=index,
        total_mb=int(memory.total) // _MB,
        reserve_mb=reserve_mb,
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
    )


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def local_inventory(settings: GpuBrokerSettings, *, node: str) -> dict[str, list[GpuState]]:
    """node -> GPUs to register at start. NVML GPUs are registered under `node`."""
    if settings.use_nvml:
        gpus = nvml_inventory(node, reserve_mb=settings.reserve_mb)
        if gpus:
            return {node: gpus}
    return declared_inventory(settings)
