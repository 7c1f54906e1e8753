"""Ray Serve engine: a model that already lives in a Ray Serve deployment stays there.

    backend: ray_serve
    deployment: Policy          # the deployment's name
    app_name: policy-app        # its Serve application (default "default")
    address: auto               # attach to this Ray cluster and call a deployment handle
    route: http://head:8000/policy   # else (or when Ray is not importable) POST here
    timeout_s: 30

Handle path (the worker joins the cluster as a driver): `serve.get_deployment_handle(
deployment, app_name).remote(inputs).result(timeout_s=...)`; the deployment receives
`dict[str, np.ndarray]` and returns a dict of array-likes.

HTTP path: `POST route` with JSON `{"inputs": {name: {"dtype", "shape", "data"}}}`
(data: the flat list of values) and expects `{"outputs": {name: {...same...}}}` back.
`encode_json_tensors` / `decode_json_tensors` are that protocol, for deployments to use.

The model's memory is Ray's, not this worker's: the lease is `vram_mb` when given, else 1 MB.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from loadmaster.model_pool.engines.base import Engine, EngineContext, outputs_to_numpy
from loadmaster.model_pool.repository import ModelConfigError, ModelSpec, RayServeModelConfig

__all__ = ["RayServeEngine", "decode_json_tensors", "encode_json_tensors"]


def encode_json_tensors(arrays: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, value in arrays.items():
        array = np.asarray(value)
        out[name] = {"dtype": array.dtype.name, "shape": list(array.shape), "data": array.ravel().tolist()}
    return out


def decode_json_tensors(data: Any) -> dict[str, np.ndarray]:
    if not isinstance(data, Mapping):
        raise ValueError("tensors must be a JSON object {name: {dtype, shape, data}}")
    out = {}
    for name, tensor in data.items():
        try:
            out[str(name)] = np.asarray(tensor["data"], dtype=np.dtype(tensor["dtype"])).reshape(
                tensor["shape"]
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"tensor '{name}': {error}") from None
    return out


def _config(spec: ModelSpec) -> RayServeModelConfig:
    assert isinstance(spec.config, RayServeModelConfig)
    return spec.config


class RayServeEngine(Engine):
    backend = "ray_serve"

    def __init__(self, spec: ModelSpec, context: EngineContext) -> None:
        super().__init__(spec, context)
        self._handle: Any = None
        self._route: str | None = None

    @classmethod
    def artifact_files(cls, spec: ModelSpec) -> Iterable[Path]:
        return []  # nothing here: the model lives in Ray

    def load(self) -> None:
        config = _config(self.spec)
        if config.address is not None:
            try:
                import ray
                from ray import serve
            except ImportError:
                if config.route is None:
                    raise ModelConfigError(
                        f"model '{self.spec.model_id}': ray is not installed (loadmaster-model-pool[ray]) "
                        "and no HTTP route is configured"
                    ) from None
            else:
                if not ray.is_initialized():
                    ray.init(address=config.address, ignore_reinit_error=True, log_to_driver=False)
                self._handle = serve.get_deployment_handle(config.deployment, app_name=config.app_name)
                return
        if config.route is None:
            raise ModelConfigError(f"model '{self.spec.model_id}': ray_serve needs `address` or `route`")
        self._route = config.route

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        timeout_s = _config(self.spec).timeout_s
        if self._handle is not None:
            result = self._handle.remote(dict(inputs)).result(timeout_s=timeout_s)
            return outputs_to_numpy(self.spec.model_id, result)
        if self._route is None:
            raise RuntimeError(f"model '{self.spec.model_id}' is not loaded")
        body = json.dumps({"inputs": encode_json_tensors(inputs)}).encode()
        request = urllib.request.Request(
            self._route, data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                reply = json.loads(response.read())
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:300]
            raise RuntimeError(f"Ray Serve route {self._route} answered {error.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError) as error:
            raise RuntimeError(f"Ray Serve route {self._route} unreachable: {error}") from None
        return decode_json_tensors(reply.get("outputs") if isinstance(reply, dict) else None)

    def unload(self) -> None:
        self._handle = None
        self._route = None
