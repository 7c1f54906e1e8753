from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loadmaster.common.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from loadmaster.model_pool.repository import (
    ModelConfigError,
    ModelRepository,
    PythonModelConfig,
    TorchModelConfig,
    check_inputs,
    zeros_for,
)

EXAMPLES = Path(__file__).resolve().parents[4] / "examples" / "models"


def write(root: Path, model_id: str, config: str, files: dict[str, str] | None = None) -> None:
    folder = root / model_id
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(config)
    for name, text in (files or {}).items():
        (folder / name).write_text(text)


def test_example_configs_are_valid() -> None:
    repo = ModelRepository(EXAMPLES)
    assert {"classifier", "double", "policy", "policy-onnx", "sleep"} <= set(repo.names())
    policy = repo.spec("policy").config
    assert isinstance(policy, TorchModelConfig)
    assert policy.artifact_format == "torchscript"
    assert [(t.name, t.dtype, t.shape) for t in policy.inputs] == [("state", "float32", (-1, 32))]
    classifier = repo.spec("classifier").config
    assert isinstance(classifier, TorchModelConfig) and classifier.artifact_format == "export"
    double = repo.spec("double").config
    assert isinstance(double, PythonModelConfig) and double.class_name == "Double"


def test_names_skip_folders_without_config(tmp_path: Path) -> None:
    write(tmp_path, "a", "backend: python\nclass: A\n")
    (tmp_path / "no-config").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "config.yaml").write_text("backend: python\nclass: A\n")
    (tmp_path / "file.txt").write_text("x")
    assert ModelRepository(tmp_path).names() == ["a"]
    assert ModelRepository(tmp_path / "missing").names() == []


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ("backend: caffe\nartifact: m.caffemodel\n", "backend"),
        ("backend: python\n", "class: Field required"),
        ("backend: torch\n", "artifact: Field required"),
        ("backend: python\nclass: A\nflavour: x\n", "flavour: Extra inputs are not permitted"),
        ("backend: python\nclass: A\ndevice: tpu\n", "device"),
        ("backend: python\nclass: A\ninputs: [{name: x, dtype: complex64}]\n", "inputs.0.dtype"),
        ("backend: python\nclass: A\ninputs: [{name: x, dtype: uint8, shape: [-2]}]\n", "-1 for any size"),
        (
            "backend: python\nclass: A\ninputs: [{name: x, dtype: uint8}, {name: x, dtype: uint8}]\n",
            "duplicate",
        ),
        ("backend: python\nclass: A\nvram_mb: -1\n", "vram_mb"),
        ("- just\n- a list\n", "must be a mapping"),
        ("backend: [unclosed\n", "cannot read config.yaml"),
    ],
)
def test_broken_config_is_an_error_for_that_model_only(tmp_path: Path, config: str, fragment: str) -> None:
    write(tmp_path, "broken", config)
    write(tmp_path, "good", "backend: python\nclass: Good\n")
    repo = ModelRepository(tmp_path)
    assert repo.names() == ["broken", "good"]
    with pytest.raises(ModelConfigError) as caught:
        repo.spec("broken")
    assert "model 'broken'" in caught.value.message
    assert fragment in caught.value.message
    assert isinstance(caught.value, FailedPreconditionError)
    assert repo.spec("good").config.backend == "python"


@pytest.mark.parametrize("model_id", ["missing", "../escape", "", ".hidden", "a/b"])
def test_unknown_model_is_not_found(tmp_path: Path, model_id: str) -> None:
    with pytest.raises(NotFoundError):
        ModelRepository(tmp_path).spec(model_id)


def test_files_named_in_a_config_stay_in_the_model_folder(tmp_path: Path) -> None:
    write(tmp_path, "m", "backend: torch\nartifact: ../../etc/passwd\n")
    spec = ModelRepository(tmp_path).spec("m")
    with pytest.raises(ModelConfigError, match="outside its folder"):
        spec.path(spec.config.artifact)  # type: ignore[union-attr]


def test_format_follows_the_suffix_unless_given(tmp_path: Path) -> None:
    write(tmp_path, "a", "backend: torch\nartifact: a.pt2\n")
    write(tmp_path, "b", "backend: torch\nartifact: b.bin\nformat: export\n")
    write(tmp_path, "c", "backend: torch\nartifact: c.ts\n")
    repo = ModelRepository(tmp_path)
    formats = [repo.spec(m).config.artifact_format for m in "abc"]  # type: ignore[union-attr]
    assert formats == ["export", "export", "torchscript"]


def _spec(tmp_path: Path, inputs: str, extra: bool = False):  # type: ignore[no-untyped-def]
    write(
        tmp_path,
        "m",
        f"backend: python\nclass: A\nallow_extra_inputs: {str(extra).lower()}\ninputs: {inputs}\n",
    )
    return ModelRepository(tmp_path).spec("m")


def test_check_inputs_names_the_tensor(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "[{name: state, dtype: float32, shape: [-1, 4]}]")
    check_inputs(spec, {"state": np.zeros((3, 4), np.float32)})
    check_inputs(spec, {"state": np.zeros((0, 4), np.float32)})
    cases = [
        ({}, "needs input tensor 'state'"),
        ({"state": np.zeros((3, 4), np.float64)}, "tensor 'state': dtype float64"),
        ({"state": np.zeros((3, 5), np.float32)}, "tensor 'state': shape [3, 5]"),
        ({"state": np.zeros((4,), np.float32)}, "tensor 'state': shape [4]"),
        ({"state": np.zeros((1, 4), np.float32), "other": np.zeros(1)}, "tensor 'other' is not an input"),
    ]
    for arrays, message in cases:
        with pytest.raises(InvalidArgumentError, match=message.replace("[", r"\[").replace("]", r"\]")):
            check_inputs(spec, arrays)


def test_extra_inputs_allowed_when_configured(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "[{name: ms, dtype: float32}]", extra=True)
    check_inputs(spec, {"ms": np.zeros((), np.float32), "echo": np.zeros((2, 2), np.uint8)})


def test_described_inputs_are_not_enforced_when_configured(tmp_path: Path) -> None:
    write(
        tmp_path,
        "any",
        "backend: python\nclass: A\nenforce_inputs: false\n"
        "inputs: [{name: x, dtype: float32, shape: [-1]}]\noutputs: [{name: x, dtype: float32, shape: [-1]}]\n",
    )
    spec = ModelRepository(tmp_path).spec("any")
    check_inputs(spec, {"joints": np.zeros((2, 3), np.int64)})  # any tensors, as `double` takes
    assert [t.name for t in spec.config.outputs] == ["x"]


def test_every_example_tensor_model_describes_its_tensors() -> None:
    # KServe ModelMetadata lists these: no tensor model may report empty inputs or outputs.
    repo = ModelRepository(EXAMPLES)
    for name in repo.names():
        config = repo.spec(name).config
        if config.backend in {
            "transformers",
            "transformers_vlm",
            "openai_process",
            "remote_openai",
            "python_generative",
        }:
            continue  # language models: the gateway describes their text tensors (kserve_generative.py)
        assert config.inputs and config.outputs, name


def test_zeros_for_warmup_makes_empty_byte_strings_for_bytes_tensors() -> None:
    specs = ModelRepository(EXAMPLES).spec("tiny-diffusion").config.inputs
    zeros = zeros_for(specs)
    assert zeros is not None and zeros["prompt"].tolist() == [b""] and zeros["size"].dtype == np.int32


def test_zeros_for_warmup() -> None:
    spec = ModelRepository(EXAMPLES).spec("policy")
    zeros = zeros_for(spec.config.inputs)
    assert zeros is not None and zeros["state"].shape == (1, 32) and zeros["state"].dtype == np.float32
    assert zeros_for(ModelRepository(EXAMPLES).spec("sleep").config.inputs) is None  # shape not declared
    assert zeros_for(()) is None
