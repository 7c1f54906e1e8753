from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from loadmaster.model_pool.engines import ENGINES, EngineContext, engine_class
from loadmaster.model_pool.engines.base import outputs_to_numpy
from loadmaster.model_pool.engines.python import PythonEngine
from loadmaster.model_pool.engines.torch import TorchEngine
from loadmaster.model_pool.repository import ModelConfigError, ModelRepository, ModelSpec

CPU = EngineContext(device="cpu", threads=1)


def make_model(root: Path, model_id: str, config: str, files: dict[str, str] | None = None) -> ModelSpec:
    folder = root / model_id
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(config)
    for name, text in (files or {}).items():
        (folder / name).write_text(text)
    return ModelRepository(root).spec(model_id)


def test_registry() -> None:
    assert set(ENGINES) == {
        "python",
        "python_generative",
        "torch",
        "onnx",
        "tensorrt",
        "ray_serve",
        "transformers",
        "transformers_vlm",
        "openai_process",
        "remote_openai",
        "diffusers",
        "embedding",
    }
    assert engine_class("python") is PythonEngine
    assert engine_class("torch") is TorchEngine
    with pytest.raises(ModelConfigError, match="no engine for backend 'caffe'"):
        engine_class("caffe")


# ---- python ---------------------------------------------------------------


def test_python_engine_runs_the_example_double(example_repo: Path) -> None:
    engine = PythonEngine(ModelRepository(example_repo).spec("double"), CPU)
    engine.load()
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    img = np.array([1, 100, 200], dtype=np.uint8)
    out = engine.infer({"x": x, "img": img})
    assert out["x"].dtype == np.int32 and (out["x"] == x * 2).all()
    assert out["img"].dtype == np.uint8 and list(out["img"]) == [2, 200, 144]  # uint8 wraps, dtype kept
    engine.unload()


PY_MODEL = """
import numpy as np
import torch

CALLS = []

class Model:
    def load(self):
        CALLS.append("load")
    def infer(self, inputs):
        return {"torch": torch.ones(2, dtype=torch.float32), "list": [1, 2, 3], "same": inputs["a"]}
    def unload(self):
        CALLS.append("unload")
"""


def test_python_engine_converts_outputs_and_calls_hooks(tmp_path: Path) -> None:
    spec = make_model(tmp_path, "m", "backend: python\nclass: Model\n", {"model.py": PY_MODEL})
    engine = PythonEngine(spec, CPU)
    engine.load()
    module = engine._model.__class__.__module__
    import sys

    calls = sys.modules[module].CALLS
    out = engine.infer({"a": np.zeros(3, np.float32)})
    assert out["torch"].dtype == np.float32 and out["list"].tolist() == [1, 2, 3]
    engine.unload()
    assert calls == ["load", "unload"]
    assert module not in sys.modules


@pytest.mark.parametrize(
    ("files", "config", "message"),
    [
        ({}, "backend: python\nclass: Model\n", "module .* not found"),
        ({"model.py": "class Other: pass\n"}, "backend: python\nclass: Model\n", "has no class 'Model'"),
        ({"model.py": "class Model: pass\n"}, "backend: python\nclass: Model\n", "has no infer"),
    ],
)
def test_python_engine_load_errors(tmp_path: Path, files: dict[str, str], config: str, message: str) -> None:
    engine = PythonEngine(make_model(tmp_path, "m", config, files), CPU)
    with pytest.raises(ModelConfigError, match=message):
        engine.load()


def test_outputs_must_be_a_dict() -> None:
    with pytest.raises(ValueError, match="expected a dict"):
        outputs_to_numpy("m", [1, 2])
    with pytest.raises(ValueError, match="names are strings"):
        outputs_to_numpy("m", {1: np.zeros(1)})


# ---- torch ----------------------------------------------------------------


def test_torch_engine_torchscript_policy_matches_reference(example_repo: Path) -> None:
    spec = ModelRepository(example_repo).spec("policy")
    reference = np.load(example_repo / "policy" / "artifacts" / "reference.npz")
    engine = TorchEngine(spec, CPU)
    engine.load()
    engine.warmup()
    out = engine.infer({"state": reference["input.state"]})
    assert list(out) == ["action"]
    np.testing.assert_allclose(out["action"], reference["output.action"], rtol=1e-5, atol=1e-6)
    engine.unload()


class TwoInputs(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a + b, a * b


def _readonly(array: np.ndarray) -> np.ndarray:
    view = np.frombuffer(array.tobytes(), dtype=array.dtype).reshape(array.shape)
    assert not view.flags.writeable
    return view


def test_torch_engine_export_pt2(tmp_path: Path) -> None:
    folder = tmp_path / "pair" / "artifacts"
    folder.mkdir(parents=True)
    example = (torch.zeros(2, 3), torch.zeros(2, 3))
    batch = torch.export.Dim("batch", max=1024)
    program = torch.export.export(TwoInputs(), example, dynamic_shapes=({0: batch}, {0: batch}))
    torch.export.save(program, str(folder / "pair.pt2"))
    spec = make_model(
        tmp_path,
        "pair",
        "backend: torch\nartifact: artifacts/pair.pt2\n"
        "inputs: [{name: b, dtype: float32, shape: [-1, 3]}, {name: a, dtype: float32, shape: [-1, 3]}]\n"
        "outputs: [{name: sum, dtype: float32}, {name: product, dtype: float32}]\n",
    )
    engine = TorchEngine(spec, CPU)
    engine.load()
    engine.warmup()
    a = _readonly(np.full((4, 3), 2.0, np.float32))
    b = _readonly(np.full((4, 3), 3.0, np.float32))
    out = engine.infer({"a": a, "b": b})  # positional in the config's order: forward(b, a)
    assert sorted(out) == ["product", "sum"]
    assert (out["sum"] == 5.0).all() and (out["product"] == 6.0).all() and out["sum"].shape == (4, 3)
    engine.unload()


def test_torch_engine_keyword_inputs_without_declared_inputs(tmp_path: Path) -> None:
    folder = tmp_path / "kw" / "artifacts"
    folder.mkdir(parents=True)
    torch.jit.script(TwoInputs()).save(str(folder / "kw.pt"))
    spec = make_model(tmp_path, "kw", "backend: torch\nartifact: artifacts/kw.pt\n")
    engine = TorchEngine(spec, CPU)
    engine.load()
    out = engine.infer({"b": np.full(2, 3.0, np.float32), "a": np.full(2, 1.0, np.float32)})
    assert sorted(out) == ["output_0", "output_1"]
    assert out["output_0"].tolist() == [4.0, 4.0]
    engine.unload()


def test_torch_engine_missing_artifact_is_a_config_error(tmp_path: Path) -> None:
    spec = make_model(tmp_path, "m", "backend: torch\nartifact: artifacts/none.pt\n")
    with pytest.raises(ModelConfigError, match="make models"):
        TorchEngine(spec, CPU).load()
    with pytest.raises(ModelConfigError):
        TorchEngine.estimate_mb(spec)


def test_estimate_is_artifact_size_times_1_3(tmp_path: Path) -> None:
    spec = make_model(tmp_path, "big", "backend: torch\nartifact: w.bin\n")
    (spec.folder / "w.bin").write_bytes(b"\0" * (10 << 20))
    assert TorchEngine.estimate_mb(spec) == 13
    tiny = make_model(tmp_path, "tiny", "backend: torch\nartifact: w.bin\n")
    (tiny.folder / "w.bin").write_bytes(b"\0" * 10)
    assert TorchEngine.estimate_mb(tiny) == 1  # at least 1 MB
    py = make_model(tmp_path, "py", "backend: python\nclass: M\n", {"model.py": "x" * (2 << 20)})
    assert PythonEngine.estimate_mb(py) == 3  # ceil(2 MB x 1.3)


def test_torch_engine_cuda_without_cuda_fails_to_load(example_repo: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    engine = TorchEngine(ModelRepository(example_repo).spec("policy"), EngineContext(device="cuda:0"))
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        engine.load()


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: GPU path not exercised on this machine"
)
def test_torch_engine_on_cuda(example_repo: Path) -> None:
    spec = ModelRepository(example_repo).spec("policy")
    reference = np.load(example_repo / "policy" / "artifacts" / "reference.npz")
    engine = TorchEngine(spec, EngineContext(device="cuda:0"))
    engine.load()
    out = engine.infer({"state": reference["input.state"]})
    np.testing.assert_allclose(out["action"], reference["output.action"], rtol=1e-4, atol=1e-5)
    engine.unload()
    assert torch.cuda.memory_allocated(0) == 0
