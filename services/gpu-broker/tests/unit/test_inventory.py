"""Start-up inventory: the declared GPUs unless NVML is installed, enabled and finds GPUs."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from loadmaster.common.config import GpuBrokerSettings, GpuSpec
from loadmaster.gpu_broker.inventory import local_inventory

DECLARED = GpuBrokerSettings(
    reserve_mb=256,
    declared={"n1": [GpuSpec(index=0, total_mb=8_000), GpuSpec(index=1, total_mb=4_000, name="small")]},
)


def test_declared_inventory_without_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    inventory = local_inventory(DECLARED, node="host")
    assert list(inventory) == ["n1"]
    assert [(g.index, g.total_mb, g.reserve_mb, g.name) for g in inventory["n1"]] == [
        (0, 8_000, 256, "declared"),
        (1, 4_000, 256, "small"),
    ]


def _fake_nvml(count: int) -> types.ModuleType:
    module: Any = types.ModuleType("pynvml")
    module.nvmlInit = lambda: None
    module.nvmlShutdown = lambda: None
    module.nvmlDeviceGetCount = lambda: count
    module.nvmlDeviceGetHandleByIndex = lambda index: index
    module.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(total=24 << 30, used=1 << 30)
    module.nvmlDeviceGetName = lambda handle: b"Fake GPU"
    module.nvmlDeviceGetUUID = lambda handle: f"GPU-{handle}"
    return module


def test_nvml_gpus_replace_the_declared_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(2))
    inventory = local_inventory(DECLARED, node="host")
    assert list(inventory) == ["host"]
    assert [(g.index, g.total_mb, g.reserve_mb, g.name, g.uuid) for g in inventory["host"]] == [
        (0, 24_576, 256, "Fake GPU", "GPU-0"),
        (1, 24_576, 256, "Fake GPU", "GPU-1"),
    ]


def test_nvml_with_no_gpus_or_disabled_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(0))
    assert list(local_inventory(DECLARED, node="host")) == ["n1"]
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(2))
    assert list(local_inventory(DECLARED.model_copy(update={"use_nvml": False}), node="host")) == ["n1"]
