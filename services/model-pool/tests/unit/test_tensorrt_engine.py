"""TensorRT: the pure parts everywhere; the engine itself only with a GPU and the tensorrt package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.model_pool.engines import engine_class
from loadmaster.model_pool.engines.base import EngineContext
from loadmaster.model_pool.engines.tensorrt import (
    TensorBinding,
    TensorRTEngine,
    check_batch_limit,
    numpy_dtype,
    plan_bindings,
)
from loadmaster.model_pool.repository import ModelConfigError, parse_config

STATE = TensorBinding("state", True, np.dtype(np.float32), (-1, 32), (1, 32), (16, 32))
ACTION = TensorBinding("action", False, np.dtype(np.float32), (-1, 8))


def test_dtypes() -> None:
    assert numpy_dtype("DataType.FLOAT") == np.float32
    assert numpy_dtype("HALF") == np.float16
    assert numpy_dtype("BF16") == np.uint16
    with pytest.raises(ModelConfigError, match="FP8"):
        numpy_dtype("FP8")


def test_binding_plan_within_the_profile() -> None:
    state = np.zeros((4, 32), dtype=np.float32)
    plan = plan_bindings([STATE, ACTION], {"state": state})
    assert plan.input_shapes == {"state": (4, 32)} and plan.outputs == ("action",)
    assert plan.inputs["state"].flags.c_contiguous


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.zeros((4, 32), dtype=np.float64), "dtype float64"),
        (np.zeros((32,), dtype=np.float32), "rank 1"),
        (np.zeros((4, 31), dtype=np.float32), "dim 1 is 31"),
        (np.zeros((17, 32), dtype=np.float32), r"outside the optimization profile \[1, 16\]"),
    ],
)
def test_binding_plan_refuses_by_tensor_name(array: np.ndarray, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message) as caught:
        plan_bindings([STATE, ACTION], {"state": array})
    assert "state" in caught.value.message
    with pytest.raises(InvalidArgumentError, match="needs input tensor 'state'"):
        plan_bindings([STATE, ACTION], {})


def test_batch_limit_against_the_profile() -> None:
    check_batch_limit([STATE, ACTION], 16)
    with pytest.raises(ModelConfigError, match="max_batch_size 32 exceeds input 'state'"):
        check_batch_limit([STATE, ACTION], 32)


def test_estimate_factor_and_missing_plan(tmp_path: Path) -> None:
    (tmp_path / "m.plan").write_bytes(b"x" * (10 << 20))
    spec = parse_config("m", tmp_path, {"backend": "tensorrt", "artifact": "m.plan"})
    assert engine_class("tensorrt") is TensorRTEngine
    assert TensorRTEngine.estimate_mb(spec) == 11  # 10 MB x 1.1
    missing = parse_config("m", tmp_path, {"backend": "tensorrt", "artifact": "nope.plan"})
    with pytest.raises(ModelConfigError, match="not found"):
        TensorRTEngine.estimate_mb(missing)


def test_without_tensorrt_or_cuda_load_is_a_clear_config_error(tmp_path: Path) -> None:
    (tmp_path / "m.plan").write_bytes(b"plan")
    spec = parse_config("m", tmp_path, {"backend": "tensorrt", "artifact": "m.plan"})
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed: the GPU test covers loading")
    with pytest.raises(ModelConfigError, match="TensorRT is not installed"):
        TensorRTEngine(spec, EngineContext(device="cpu")).load()


def _gpu_and_tensorrt() -> bool:
    if importlib.util.find_spec("tensorrt") is None:
        return False
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(
    not _gpu_and_tensorrt(), reason="needs an NVIDIA GPU and the tensorrt package (none on CI)"
)
def test_policy_as_a_tensorrt_plan_matches_its_reference(example_repo: Path, tmp_path: Path) -> None:
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse((example_repo / "policy-onnx" / "artifacts" / "policy.onnx").read_bytes())
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape("state", (1, 32), (8, 32), (16, 32))
    config.add_optimization_profile(profile)
    (tmp_path / "policy.plan").write_bytes(bytes(builder.build_serialized_network(network, config)))
    spec = parse_config(
        "policy-trt", tmp_path, {"backend": "tensorrt", "artifact": "policy.plan", "max_batch_size": 8}
    )
    engine = TensorRTEngine(spec, EngineContext(device="cuda:0"))
    engine.load()
    reference = np.load(example_repo / "policy-onnx" / "artifacts" / "reference.npz")
    outputs = engine.infer({"state": reference["input.state"]})
    np.testing.assert_allclose(outputs["action"], reference["output.action"], rtol=1e-3, atol=1e-4)
    engine.unload()
