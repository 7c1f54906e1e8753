"""ONNX Runtime engine on CPU: the `policy-onnx` example answers like `policy`; provider choice."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loadmaster.model_pool.engines import engine_class
from loadmaster.model_pool.engines.base import EngineContext
from loadmaster.model_pool.engines.onnx import OnnxEngine, choose_providers
from loadmaster.model_pool.repository import ModelConfigError, ModelRepository, parse_config


def test_policy_onnx_matches_its_reference_and_the_torch_policy(example_repo: Path) -> None:
    spec = ModelRepository(example_repo).spec("policy-onnx")
    assert engine_class("onnx") is OnnxEngine
    engine = OnnxEngine(spec, EngineContext(device="cpu", threads=1))
    engine.load()
    engine.warmup()
    reference = np.load(example_repo / "policy-onnx" / "artifacts" / "reference.npz")
    torch_reference = np.load(example_repo / "policy" / "artifacts" / "reference.npz")
    outputs = engine.infer({"state": reference["input.state"]})
    assert set(outputs) == {"action"} and outputs["action"].shape == (4, 8)
    np.testing.assert_allclose(outputs["action"], reference["output.action"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outputs["action"], torch_reference["output.action"], rtol=1e-4, atol=1e-5)
    engine.unload()
    with pytest.raises(RuntimeError, match="not loaded"):
        engine.infer({"state": reference["input.state"]})


def test_estimate_uses_the_artifact_size(example_repo: Path) -> None:
    spec = ModelRepository(example_repo).spec("policy-onnx")
    size = (example_repo / "policy-onnx" / "artifacts" / "policy.onnx").stat().st_size
    assert OnnxEngine.estimate_mb(spec) == max(1, -(-int(size * 1.3) // (1 << 20)))


def test_a_broken_artifact_or_undeclared_input_is_a_config_error(tmp_path: Path, example_repo: Path) -> None:
    (tmp_path / "m.onnx").write_bytes(b"not onnx")
    spec = parse_config("m", tmp_path, {"backend": "onnx", "artifact": "m.onnx"})
    with pytest.raises(ModelConfigError, match="cannot load"):
        OnnxEngine(spec, EngineContext(device="cpu")).load()
    onnx_file = example_repo / "policy-onnx" / "artifacts" / "policy.onnx"
    spec = parse_config(
        "m",
        onnx_file.parent,
        {"backend": "onnx", "artifact": "policy.onnx", "inputs": [{"name": "obs", "dtype": "float32"}]},
    )
    with pytest.raises(ModelConfigError, match="declared input 'obs' is not in the graph"):
        OnnxEngine(spec, EngineContext(device="cpu")).load()


def test_provider_choice() -> None:
    gpu = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert choose_providers("cpu", gpu) == [("CPUExecutionProvider", {})]
    assert choose_providers("cuda:1", gpu) == [
        ("TensorrtExecutionProvider", {"device_id": 1}),
        ("CUDAExecutionProvider", {"device_id": 1}),
        ("CPUExecutionProvider", {}),
    ]
    assert choose_providers("cuda", ["CUDAExecutionProvider", "CPUExecutionProvider"])[0] == (
        "CUDAExecutionProvider",
        {"device_id": 0},
    )
    with pytest.raises(ModelConfigError, match="needs onnxruntime-gpu"):
        choose_providers("cuda:0", ["CPUExecutionProvider"])
    with pytest.raises(ModelConfigError, match="no provider CUDAExecutionProvider"):
        choose_providers("cpu", ["CPUExecutionProvider"], ["CUDAExecutionProvider"])
