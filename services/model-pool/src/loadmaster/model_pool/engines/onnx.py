"""ONNX Runtime engine: an `.onnx` file run by an `InferenceSession`.

Providers: the config's `providers` when given; otherwise, on a `cuda:N` device,
TensorRT and CUDA (pinned to device N) when this onnxruntime build has them, then
CPU. On `cpu`, the CPU provider with `context.threads` intra-op threads. Inputs are
fed by name (declared inputs may only narrow what the graph accepts); outputs keep
the graph's names. On CUDA the session is dropped at unload, which returns its arena.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from loadmaster.model_pool.engines.base import Engine, EngineContext
from loadmaster.model_pool.repository import ModelConfigError, ModelSpec, OnnxModelConfig

__all__ = ["OnnxEngine", "choose_providers"]


def _config(spec: ModelSpec) -> OnnxModelConfig:
    assert isinstance(spec.config, OnnxModelConfig)
    return spec.config


def choose_providers(
    device: str, available: Iterable[str], configured: Iterable[str] | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """(provider, options) in order of preference for `device`, from what the runtime offers."""
    offered = list(available)
    kind, _, index = device.partition(":")
    gpu = int(index) if index else 0
    if configured is not None:
        wanted = list(configured)
        missing = [p for p in wanted if p not in offered]
        if missing:
            raise ModelConfigError(
                f"onnxruntime has no provider {', '.join(missing)} (available: {', '.join(offered)})"
            )
    elif kind == "cuda":
        wanted = [p for p in ("TensorrtExecutionProvider", "CUDAExecutionProvider") if p in offered]
        if not wanted:
            raise ModelConfigError(
                f"device {device} needs onnxruntime-gpu (CUDA provider); available: {', '.join(offered)}"
            )
        wanted.append("CPUExecutionProvider")
    else:
        wanted = ["CPUExecutionProvider"]
    out: list[tuple[str, dict[str, Any]]] = []
    for name in wanted:
        options: dict[str, Any] = {}
        if name in ("CUDAExecutionProvider", "TensorrtExecutionProvider") and kind == "cuda":
            options["device_id"] = gpu
        out.append((name, options))
    return out


class OnnxEngine(Engine):
    backend = "onnx"

    def __init__(self, spec: ModelSpec, context: EngineContext) -> None:
        super().__init__(spec, context)
        self._session: ort.InferenceSession | None = None
        self._input_names: tuple[str, ...] = ()

    @classmethod
    def artifact_files(cls, spec: ModelSpec) -> Iterable[Path]:
        path = spec.path(_config(spec).artifact)
        if not path.is_file():
            raise ModelConfigError(
                f"model '{spec.model_id}': artifact {path} not found (example models: `make models`)"
            )
        return [path]

    def load(self) -> None:
        (path,) = self.artifact_files(self.spec)
        providers = choose_providers(
            self.context.device, ort.get_available_providers(), _config(self.spec).providers
        )
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.context.threads
        options.inter_op_num_threads = 1
        try:
            session = ort.InferenceSession(
                str(path),
                sess_options=options,
                providers=[name for name, _ in providers],
                provider_options=[opts for _, opts in providers],
            )
        except Exception as error:  # onnxruntime raises its own Fail/InvalidGraph types
            raise ModelConfigError(f"model '{self.spec.model_id}': cannot load {path}: {error}") from None
        self._input_names = tuple(i.name for i in session.get_inputs())
        declared = {t.name for t in self.spec.config.inputs}
        unknown = sorted(declared - set(self._input_names))
        if unknown:
            raise ModelConfigError(
                f"model '{self.spec.model_id}': declared input '{unknown[0]}' is not in the graph "
                f"(graph inputs: {', '.join(self._input_names)})"
            )
        self._session = session

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        session = self._session
        if session is None:
            raise RuntimeError(f"model '{self.spec.model_id}' is not loaded")
        feed = {name: inputs[name] for name in self._input_names if name in inputs}
        names = [o.name for o in session.get_outputs()]
        results = session.run(names, feed)
        return {name: np.asarray(value) for name, value in zip(names, results, strict=True)}

    def unload(self) -> None:
        self._session = None
        gc.collect()
