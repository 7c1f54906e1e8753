"""A Hugging Face model folder: config.json required, the weights listed in order, and a
clear error naming the model and the folder when either is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadmaster.model_pool.engines._hf_folder import hf_folder, safetensors_files
from loadmaster.model_pool.repository import EmbeddingModelConfig, ModelConfigError, ModelSpec


def _spec(folder: Path) -> ModelSpec:
    return ModelSpec("m", folder, EmbeddingModelConfig(backend="embedding", path="hf"))


def test_a_folder_with_config_and_weights_lists_them_in_order(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    for name in ("b.safetensors", "a.safetensors", "notes.txt"):
        (hf / name).write_bytes(b"x")
    spec = _spec(tmp_path)
    folder = hf_folder(spec, "hf")
    assert folder == hf.resolve()
    assert [p.name for p in safetensors_files(spec, folder)] == ["a.safetensors", "b.safetensors"]


def test_a_missing_config_or_missing_weights_name_the_model_and_folder(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    spec = _spec(tmp_path)
    with pytest.raises(ModelConfigError, match=r"model 'm': no config.json in .*hf"):
        hf_folder(spec, "hf")
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(ModelConfigError, match=r"model 'm': no \*.safetensors in .*hf"):
        safetensors_files(spec, hf_folder(spec, "hf"))
