"""The engine interface every backend implements.

An engine owns one loaded copy of one model. The pool calls every method on the
model's own single-thread executor, never on the event loop, so engines may block
and may keep thread-affine state (CUDA streams, interpreter handles):

    estimate_mb(spec)  class method, before anything is loaded: the memory to lease
    load()             read the artifact, place it on `context.device`
    warmup()           optional first call, so the first request does not pay for it
    infer(inputs)      dict[str, ndarray] -> dict[str, ndarray]; inputs are read-only views
    unload()           free everything, device memory included, before returning

Batching is the pool's business (`batcher.py`): with `max_batch_size` > 1 in the
config, `infer` receives requests stacked on dim 0 and must return outputs with the
same rows on dim 0. `estimate_factor` scales the artifact size into the lease size
when the config gives no `vram_mb`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from loadmaster.model_pool.generation_order import OrderPolicy
from loadmaster.model_pool.repository import ModelConfigError, ModelSpec, zeros_for

__all__ = ["ESTIMATE_FACTOR", "Engine", "EngineContext", "outputs_to_numpy", "warmup_inputs"]

# Lease estimate when a model gives no `vram_mb`: artifact bytes x this factor (the
# default; engines override `estimate_factor`, e.g. 1.1 for TensorRT plans).
ESTIMATE_FACTOR = 1.3


@dataclass(frozen=True, slots=True)
class EngineContext:
    device: str  # "cpu" or "cuda:N" (already resolved against the lease)
    threads: int = 1  # intra-op threads, for engines that have such a knob
    gpus: tuple[int, ...] = ()  # every GPU of the lease (several for a split lease)
    # Called from any thread when a loaded engine can no longer serve (its process exited):
    # the pool unloads the model and says why. None: nobody listens.
    on_failure: Callable[[str], None] | None = None
    # How a generative engine that orders its own queue orders it (generation_order.py).
    order_policy: OrderPolicy = field(default_factory=OrderPolicy)


class Engine(ABC):
    backend: ClassVar[str]
    estimate_factor: ClassVar[float] = ESTIMATE_FACTOR
    # False: the model holds no memory of this worker's GPUs (a hosted API), so the pool takes
    # no lease for it and it neither makes room for nor is evicted for another model.
    leases_memory: ClassVar[bool] = True

    def __init__(self, spec: ModelSpec, context: EngineContext) -> None:
        self.spec = spec
        self.context = context

    # ---- memory ---------------------------------------------------------

    @classmethod
    @abstractmethod
    def artifact_files(cls, spec: ModelSpec) -> Iterable[Path]:
        """The files whose size stands for the model's memory; raise if one is missing."""

    @classmethod
    def estimate_mb(cls, spec: ModelSpec) -> int:
        """Memory to lease per instance when no `vram_mb` is given: artifact size x
        `estimate_factor`, at least 1 MB."""
        total = 0
        for path in cls.artifact_files(spec):
            try:
                total += path.stat().st_size
            except OSError as error:
                raise ModelConfigError(
                    f"model '{spec.model_id}': cannot read {path}: {error.strerror or error}"
                ) from None
        return max(1, math.ceil(total * cls.estimate_factor / (1 << 20)))

    # ---- lifecycle ------------------------------------------------------

    @abstractmethod
    def load(self) -> None: ...

    def warmup(self) -> None:
        """One call with the config's `warmup_inputs` (.npz), else zeros from the declared inputs."""
        inputs = warmup_inputs(self.spec)
        if inputs is not None:
            self.infer(inputs)

    @abstractmethod
    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    @abstractmethod
    def unload(self) -> None: ...


def warmup_inputs(spec: ModelSpec) -> dict[str, np.ndarray] | None:
    """The warm-up request: `warmup_inputs` (an .npz in the model folder) or generated zeros."""
    config = spec.config
    if not config.warmup:
        return None
    if config.warmup_inputs:
        path = spec.path(config.warmup_inputs)
        try:
            with np.load(path, allow_pickle=False) as data:
                return {name: np.asarray(data[name]) for name in data.files}
        except (OSError, ValueError) as error:
            raise ModelConfigError(f"model '{spec.model_id}': warmup_inputs {path}: {error}") from None
    return zeros_for(config.inputs)


def _to_numpy(value: Any) -> np.ndarray:
    # Duck-typed torch support, so this module never imports torch.
    if hasattr(value, "detach") and hasattr(value, "cpu") and hasattr(value, "numpy"):
        tensor = value.detach()
        if str(getattr(tensor, "dtype", "")) == "torch.bfloat16":
            tensor = tensor.float()  # numpy has no bfloat16
        return np.asarray(tensor.cpu().numpy())
    return np.asarray(value)


def outputs_to_numpy(model_id: str, outputs: Any) -> dict[str, np.ndarray]:
    """A model's outputs as `dict[str, ndarray]`; anything else is the model's bug (ValueError)."""
    if not isinstance(outputs, Mapping):
        raise ValueError(f"model '{model_id}' returned {type(outputs).__name__}, expected a dict of tensors")
    result: dict[str, np.ndarray] = {}
    for key, value in outputs.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"model '{model_id}' returned an output named {key!r}; names are strings")
        result[key] = _to_numpy(value)
    return result
