"""Python engine: a class in the model's folder with `load()` and `infer(dict) -> dict`.

    # models/double/model.py
    class Double:
        def load(self) -> None: ...                 # optional
        def infer(self, inputs): return {k: v * 2 for k, v in inputs.items()}
        def unload(self) -> None: ...               # optional

The module is imported from its file under a private name (one per load), the class
is instantiated without arguments. Outputs may be numpy arrays, torch tensors or
anything `np.asarray` accepts. Inputs are read-only views of the request bytes.
A model may raise a `loadmaster.common.errors.LoadmasterError` (e.g.
`InvalidArgumentError`) to answer with that code; any other exception is `internal`.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import numpy as np

from loadmaster.model_pool.engines.base import Engine, EngineContext, outputs_to_numpy
from loadmaster.model_pool.repository import ModelConfigError, ModelSpec, PythonModuleConfig

__all__ = ["PythonEngine"]

_counter = itertools.count(1)


def _config(spec: ModelSpec) -> PythonModuleConfig:
    assert isinstance(spec.config, PythonModuleConfig)
    return spec.config


class PythonEngine(Engine):
    backend = "python"
    required_method: ClassVar[str] = "infer"  # what the model's class must have

    def __init__(self, spec: ModelSpec, context: EngineContext) -> None:
        super().__init__(spec, context)
        self._module_name = ""
        self._model: Any = None

    @classmethod
    def artifact_files(cls, spec: ModelSpec) -> Iterable[Path]:
        module = spec.path(_config(spec).module)
        if not module.is_file():
            raise ModelConfigError(f"model '{spec.model_id}': module {module} not found")
        return [
            path
            for path in spec.folder.rglob("*")
            if path.is_file() and "__pycache__" not in path.parts and path.name != "config.yaml"
        ]

    def _import(self) -> ModuleType:
        path = self.spec.path(_config(self.spec).module)
        if not path.is_file():
            raise ModelConfigError(f"model '{self.spec.model_id}': module {path} not found")
        safe_id = "".join(ch if ch.isalnum() else "_" for ch in self.spec.model_id)
        name = f"_loadmaster_model_{safe_id}_{next(_counter)}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise ModelConfigError(f"model '{self.spec.model_id}': cannot import {path}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # dataclasses, pickle and typing look modules up here
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        self._module_name = name
        return module

    def load(self) -> None:
        config = _config(self.spec)
        module = self._import()
        cls = getattr(module, config.class_name, None)
        if cls is None or not callable(cls):
            self.unload()
            raise ModelConfigError(
                f"model '{self.spec.model_id}': {config.module} has no class '{config.class_name}'"
            )
        model = cls()
        if not callable(getattr(model, self.required_method, None)):
            self.unload()
            raise ModelConfigError(
                f"model '{self.spec.model_id}': {config.class_name} has no {self.required_method}()"
            )
        load = getattr(model, "load", None)
        if callable(load):
            load()
        self._model = model

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._model is None:
            raise RuntimeError(f"model '{self.spec.model_id}' is not loaded")
        return outputs_to_numpy(self.spec.model_id, self._model.infer(dict(inputs)))

    def unload(self) -> None:
        model, self._model = self._model, None
        try:
            unload = getattr(model, "unload", None)
            if callable(unload):
                unload()
        finally:
            if self._module_name:
                sys.modules.pop(self._module_name, None)
                self._module_name = ""
