"""A Hugging Face model folder (config.json beside *.safetensors), as the transformers,
vision-language and embedding engines read it from a model's `path`."""

from __future__ import annotations

from pathlib import Path

from loadmaster.model_pool.repository import ModelConfigError, ModelSpec

__all__ = ["hf_folder", "safetensors_files"]


def hf_folder(spec: ModelSpec, path: str) -> Path:
    """The model's folder, or ModelConfigError when it has no config.json."""
    folder = spec.path(path)
    if not (folder / "config.json").is_file():
        raise ModelConfigError(
            f"model '{spec.model_id}': no config.json in {folder} (example models: `make models`)"
        )
    return folder


def safetensors_files(spec: ModelSpec, folder: Path) -> list[Path]:
    """The folder's weights (what the model's memory is estimated from), or ModelConfigError."""
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise ModelConfigError(f"model '{spec.model_id}': no *.safetensors in {folder}")
    return weights
