"""Torch engine: TorchScript (`torch.jit.load`) or torch.export (`torch.export.load`, `.pt2`).

Calling convention: when the config declares `inputs`, tensors are passed
positionally in that order (this works for both formats); otherwise a single input
is passed positionally and several by keyword (their tensor keys).

Outputs: a dict of tensors keeps its keys; a tensor is named after the first
declared output (else `output`); a tuple/list after the declared outputs in order
(else `output_0`, `output_1`, ...).

On `cuda:N`, inputs are staged in pinned host memory and copied with
`non_blocking=True`, outputs come back the same way and the stream is synchronised
once per call; `unload()` drops the module and calls `torch.cuda.empty_cache()`, so
the memory is really free before the lease is released. Everything runs under
`torch.inference_mode()`.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loadmaster.model_pool.engines.base import Engine, EngineContext, outputs_to_numpy
from loadmaster.model_pool.repository import ModelConfigError, ModelSpec, TorchModelConfig

__all__ = ["TorchEngine"]

# Request tensors are read-only views of the received bytes and are passed to torch
# without a copy; models must not write into their inputs. Only calls made from this
# module are silenced.
warnings.filterwarnings(
    "ignore",
    message="The given NumPy array is not writable",
    category=UserWarning,
    module=r"loadmaster\.model_pool\.engines\.torch",
)


def _config(spec: ModelSpec) -> TorchModelConfig:
    assert isinstance(spec.config, TorchModelConfig)
    return spec.config


class TorchEngine(Engine):
    backend = "torch"

    def __init__(self, spec: ModelSpec, context: EngineContext) -> None:
        super().__init__(spec, context)
        self._module: Any = None
        self._device = torch.device(context.device)
        self._cuda = self._device.type == "cuda"
        self._bf16_inputs = frozenset(t.name for t in spec.config.inputs if t.dtype == "bfloat16")
        self._input_order = tuple(t.name for t in spec.config.inputs)
        self._output_names = tuple(t.name for t in spec.config.outputs)

    @classmethod
    def artifact_files(cls, spec: ModelSpec) -> Iterable[Path]:
        path = spec.path(_config(spec).artifact)
        if not path.is_file():
            raise ModelConfigError(
                f"model '{spec.model_id}': artifact {path} not found (example models: `make models`)"
            )
        return [path]

    # ---- lifecycle ------------------------------------------------------

    def load(self) -> None:
        config = _config(self.spec)
        (path,) = self.artifact_files(self.spec)
        if self.context.threads and torch.get_num_threads() != self.context.threads:
            torch.set_num_threads(self.context.threads)
        if self._cuda:
            if not torch.cuda.is_available():
                raise RuntimeError(f"device {self._device} requested but CUDA is not available")
            torch.cuda.set_device(self._device)
        if config.artifact_format == "export":
            program = torch.export.load(str(path))
            if self._cuda:
                from torch.export.passes import move_to_device_pass

                program = move_to_device_pass(program, self._device)
            self._module = program.module()  # exported programs are already in eval form
        else:
            module = torch.jit.load(str(path), map_location=self._device)
            module.eval()
            self._module = module

    def unload(self) -> None:
        self._module = None
        gc.collect()
        if self._cuda and torch.cuda.is_available():
            torch.cuda.synchronize(self._device)
            torch.cuda.empty_cache()

    # ---- inference ------------------------------------------------------

    def _tensor(self, name: str, array: np.ndarray) -> torch.Tensor:
        if name in self._bf16_inputs:
            host = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        else:
            host = torch.from_numpy(array)
        if not self._cuda:
            return host
        pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        pinned.copy_(host)
        return pinned.to(self._device, non_blocking=True)

    def _arguments(
        self, inputs: Mapping[str, np.ndarray]
    ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        if self._input_order:
            return [self._tensor(name, inputs[name]) for name in self._input_order], {}
        if len(inputs) == 1:
            ((name, array),) = inputs.items()
            return [self._tensor(name, array)], {}
        return [], {name: self._tensor(name, array) for name, array in inputs.items()}

    def _named(self, result: Any) -> dict[str, Any]:
        if isinstance(result, Mapping):
            return dict(result)
        if isinstance(result, torch.Tensor):
            return {self._output_names[0] if self._output_names else "output": result}
        if isinstance(result, Sequence):
            if self._output_names and len(self._output_names) != len(result):
                raise ValueError(
                    f"model '{self.spec.model_id}' returned {len(result)} outputs, "
                    f"its config declares {len(self._output_names)}"
                )
            names = self._output_names or tuple(f"output_{i}" for i in range(len(result)))
            return dict(zip(names, result, strict=True))
        raise ValueError(f"model '{self.spec.model_id}' returned {type(result).__name__}")

    def _to_host(self, outputs: dict[str, Any]) -> dict[str, Any]:
        if not self._cuda:
            return outputs
        host: dict[str, Any] = {}
        for name, value in outputs.items():
            if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                staged = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                staged.copy_(value, non_blocking=True)
                host[name] = staged
            else:
                host[name] = value
        torch.cuda.current_stream(self._device).synchronize()
        return host

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        module = self._module
        if module is None:
            raise RuntimeError(f"model '{self.spec.model_id}' is not loaded")
        with torch.inference_mode():
            args, kwargs = self._arguments(inputs)
            result = module(*args, **kwargs)
            outputs = self._to_host(self._named(result))
        return outputs_to_numpy(self.spec.model_id, outputs)
