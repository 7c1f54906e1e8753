"""Engine registry: the model config's `backend` -> the engine class that runs it.

Engines are imported on first use, so a worker without torch still serves Python
models. Adding a backend: an `engines/<name>.py` with an `Engine` subclass, its
config class in `repository.py`, and one line here.
"""

from __future__ import annotations

import importlib

from loadmaster.model_pool.engines.base import Engine, EngineContext
from loadmaster.model_pool.repository import ModelConfigError

__all__ = ["ENGINES", "Engine", "EngineContext", "engine_class"]

ENGINES: dict[str, str] = {
    "python": "loadmaster.model_pool.engines.python:PythonEngine",
    "python_generative": "loadmaster.model_pool.engines.python_generative:PythonGenerativeEngine",
    "torch": "loadmaster.model_pool.engines.torch:TorchEngine",
    "onnx": "loadmaster.model_pool.engines.onnx:OnnxEngine",
    "tensorrt": "loadmaster.model_pool.engines.tensorrt:TensorRTEngine",
    "ray_serve": "loadmaster.model_pool.engines.ray_serve:RayServeEngine",
    "transformers": "loadmaster.model_pool.engines.transformers:TransformersEngine",
    "transformers_vlm": "loadmaster.model_pool.engines.vision_language:VisionLanguageEngine",
    "openai_process": "loadmaster.model_pool.engines.openai_process:OpenAIProcessEngine",
    "remote_openai": "loadmaster.model_pool.engines.remote_openai:RemoteOpenAIEngine",
    "diffusers": "loadmaster.model_pool.engines.diffusers:DiffusersEngine",
    "embedding": "loadmaster.model_pool.engines.embedding:EmbeddingEngine",
}


def engine_class(backend: str) -> type[Engine]:
    target = ENGINES.get(backend)
    if target is None:
        raise ModelConfigError(f"no engine for backend '{backend}' (known: {', '.join(sorted(ENGINES))})")
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ModelConfigError(
            f"backend '{backend}' is not installed in this worker ({error}); "
            f"install loadmaster-model-pool[{backend}]"
        ) from None
    cls: type[Engine] = getattr(module, class_name)
    return cls
