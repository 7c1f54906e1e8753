"""TensorRT engine: a serialized engine (.plan / .engine) run with the TensorRT 10 API.

    runtime.deserialize_cuda_engine(plan) -> ICudaEngine; create_execution_context()
    I/O tensors by name (num_io_tensors, get_tensor_name/mode/dtype/shape)
    dynamic shapes: set_optimization_profile_async(profile), set_input_shape(name, shape)
      within get_tensor_profile_shape(name, profile) = (min, opt, max)
    set_tensor_address(name, device pointer) for every I/O tensor
    execute_async_v3(stream) on the engine's own CUDA stream, then one synchronize

Device buffers, the stream and the host<->device copies use torch's CUDA API (pinned
host staging, non-blocking copies), so the worker needs no pycuda / cuda-python.
Needs an NVIDIA GPU and the `tensorrt` package: neither exists on our CI machines,
so the GPU path is written against the documented API and its test skips; the pure
parts (dtype mapping, profile checks, binding plans) are unit-tested everywhere.
Lease estimate: plan size x 1.1 (a plan is close to its device footprint).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.model_pool.engines.base import Engine, EngineContext
from loadmaster.model_pool.repository import ModelConfigError, ModelSpec, TensorRTModelConfig

__all__ = [
    "BindingPlan",
    "TensorBinding",
    "TensorRTEngine",
    "check_batch_limit",
    "numpy_dtype",
    "plan_bindings",
]

# trt.DataType member names -> numpy dtypes as they travel on our wire (bf16 as uint16 words).
_DTYPES: dict[str, np.dtype] = {
    "FLOAT": np.dtype(np.float32),
    "HALF": np.dtype(np.float16),
    "BF16": np.dtype(np.uint16),
    "INT8": np.dtype(np.int8),
    "UINT8": np.dtype(np.uint8),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "BOOL": np.dtype(np.bool_),
}


def numpy_dtype(trt_dtype_name: str) -> np.dtype:
    """`trt.DataType.X.name` -> numpy dtype; ModelConfigError for types we cannot carry (FP8, INT4)."""
    dtype = _DTYPES.get(trt_dtype_name.rsplit(".", 1)[-1])
    if dtype is None:
        raise ModelConfigError(f"TensorRT tensor type {trt_dtype_name} is not supported on the wire")
    return dtype


@dataclass(frozen=True, slots=True)
class TensorBinding:
    """One I/O tensor of an engine, as read from it (inputs with their profile's min/max shapes)."""

    name: str
    is_input: bool
    dtype: np.dtype
    shape: tuple[int, ...]  # -1 = dynamic
    min_shape: tuple[int, ...] = ()
    max_shape: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class BindingPlan:
    """What one call sets: each input's shape (and the array, cast/contiguous), the outputs to fetch."""

    input_shapes: dict[str, tuple[int, ...]]
    inputs: dict[str, np.ndarray]
    outputs: tuple[str, ...]


def plan_bindings(bindings: Sequence[TensorBinding], arrays: Mapping[str, np.ndarray]) -> BindingPlan:
    """Check `arrays` against the engine's inputs and profile; InvalidArgumentError names the tensor."""
    shapes: dict[str, tuple[int, ...]] = {}
    inputs: dict[str, np.ndarray] = {}
    for b in bindings:
        if not b.is_input:
            continue
        array = arrays.get(b.name)
        if array is None:
            raise InvalidArgumentError(f"TensorRT engine needs input tensor '{b.name}'")
        if array.dtype != b.dtype:
            raise InvalidArgumentError(
                f"tensor '{b.name}': dtype {array.dtype.name}, the engine expects {b.dtype.name}"
            )
        shape = tuple(int(d) for d in array.shape)
        if len(shape) != len(b.shape):
            raise InvalidArgumentError(
                f"tensor '{b.name}': rank {len(shape)}, the engine expects {len(b.shape)}"
            )
        for axis, (got, want) in enumerate(zip(shape, b.shape, strict=True)):
            if want != -1 and got != want:
                raise InvalidArgumentError(
                    f"tensor '{b.name}': dim {axis} is {got}, the engine expects {want}"
                )
        if b.min_shape and b.max_shape:
            for axis, (got, low, high) in enumerate(zip(shape, b.min_shape, b.max_shape, strict=True)):
                if not low <= got <= high:
                    raise InvalidArgumentError(
                        f"tensor '{b.name}': dim {axis} is {got}, outside the optimization profile [{low}, {high}]"
                    )
        shapes[b.name] = shape
        inputs[b.name] = np.ascontiguousarray(array)
    outputs = tuple(b.name for b in bindings if not b.is_input)
    return BindingPlan(input_shapes=shapes, inputs=inputs, outputs=outputs)


def check_batch_limit(bindings: Sequence[TensorBinding], max_batch_size: int) -> None:
    """A batching model's stacked rows must fit every input's profile on dim 0."""
    for b in bindings:
        if b.is_input and b.max_shape and max_batch_size > b.max_shape[0]:
            raise ModelConfigError(
                f"max_batch_size {max_batch_size} exceeds input '{b.name}' profile max {b.max_shape[0]} on dim 0"
            )


def _config(spec: ModelSpec) -> TensorRTModelConfig:
    assert isinstance(spec.config, TensorRTModelConfig)
    return spec.config


class TensorRTEngine(Engine):
    backend = "tensorrt"
    estimate_factor = 1.1

    def __init__(self, spec: ModelSpec, context: EngineContext) -> None:
        super().__init__(spec, context)
        self._engine: Any = None
        self._context: Any = None
        self._stream: Any = None
        self._bindings: tuple[TensorBinding, ...] = ()

    @classmethod
    def artifact_files(cls, spec: ModelSpec) -> Iterable[Path]:
        path = spec.path(_config(spec).artifact)
        if not path.is_file():
            raise ModelConfigError(f"model '{spec.model_id}': engine plan {path} not found")
        return [path]

    def load(self) -> None:
        try:
            import tensorrt as trt  # type: ignore[import-not-found]
            import torch
        except ImportError as error:
            raise ModelConfigError(
                f"model '{self.spec.model_id}': TensorRT is not installed ({error})"
            ) from None
        if not self.context.device.startswith("cuda") or not torch.cuda.is_available():
            raise ModelConfigError(
                f"model '{self.spec.model_id}': TensorRT needs a CUDA device, got {self.context.device}"
            )
        device = torch.device(self.context.device)
        torch.cuda.set_device(device)
        (path,) = self.artifact_files(self.spec)
        profile = _config(self.spec).profile
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise ModelConfigError(
                f"model '{self.spec.model_id}': {path} is not a TensorRT engine for this GPU/version"
            )
        if profile >= engine.num_optimization_profiles:
            raise ModelConfigError(
                f"model '{self.spec.model_id}': profile {profile} of {engine.num_optimization_profiles}"
            )
        bindings = []
        for index in range(engine.num_io_tensors):
            name = engine.get_tensor_name(index)
            is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            low: tuple[int, ...] = ()
            high: tuple[int, ...] = ()
            if is_input:
                low, _opt, high = (tuple(s) for s in engine.get_tensor_profile_shape(name, profile))
            bindings.append(
                TensorBinding(
                    name=name,
                    is_input=is_input,
                    dtype=numpy_dtype(engine.get_tensor_dtype(name).name),
                    shape=tuple(engine.get_tensor_shape(name)),
                    min_shape=low,
                    max_shape=high,
                )
            )
        check_batch_limit(bindings, self.spec.config.max_batch_size)
        self._stream = torch.cuda.Stream(device=device)
        self._context = engine.create_execution_context()
        self._context.set_optimization_profile_async(profile, self._stream.cuda_stream)
        self._engine = engine
        self._bindings = tuple(bindings)

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        if self._context is None:
            raise RuntimeError(f"model '{self.spec.model_id}' is not loaded")
        plan = plan_bindings(self._bindings, inputs)
        device = torch.device(self.context.device)
        keep: list[torch.Tensor] = []  # device buffers live until the stream is synchronised
        with torch.cuda.stream(self._stream):
            for name, array in plan.inputs.items():
                host = torch.from_numpy(array).pin_memory()
                buffer = host.to(device, non_blocking=True)
                keep.append(buffer)
                self._context.set_input_shape(name, plan.input_shapes[name])
                self._context.set_tensor_address(name, buffer.data_ptr())
            outputs: dict[str, torch.Tensor] = {}
            by_name = {b.name: b for b in self._bindings}
            for name in plan.outputs:
                shape = tuple(self._context.get_tensor_shape(name))
                dtype = torch.from_numpy(np.empty(0, dtype=by_name[name].dtype)).dtype
                buffer = torch.empty(shape, dtype=dtype, device=device)
                outputs[name] = buffer
                self._context.set_tensor_address(name, buffer.data_ptr())
            if not self._context.execute_async_v3(self._stream.cuda_stream):
                raise RuntimeError(f"model '{self.spec.model_id}': execute_async_v3 failed")
            host_out = {}
            for name, buffer in outputs.items():
                staged = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=True)
                staged.copy_(buffer, non_blocking=True)
                host_out[name] = staged
        self._stream.synchronize()
        del keep
        return {name: tensor.numpy() for name, tensor in host_out.items()}

    def unload(self) -> None:
        self._context = None
        self._engine = None
        stream, self._stream = self._stream, None
        gc.collect()
        if stream is not None:
            import torch

            stream.synchronize()
            torch.cuda.empty_cache()
