"""The ray_serve engine against a local Ray Serve (CPU): deployment handle and HTTP route."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadmaster.common.ports import free_port
from loadmaster.model_pool.engines import engine_class
from loadmaster.model_pool.engines.base import EngineContext
from loadmaster.model_pool.engines.ray_serve import decode_json_tensors, encode_json_tensors
from loadmaster.model_pool.repository import ModelConfigError, parse_config

ray = pytest.importorskip(
    "ray", reason="ray[serve] is not installed (pip install loadmaster-model-pool[ray])"
)
serve = pytest.importorskip("ray.serve")

pytestmark = pytest.mark.slow


@serve.deployment
class Doubler:
    async def __call__(self, request: Any) -> Any:
        if isinstance(request, dict):  # deployment handle: arrays in, arrays out
            return {name: np.asarray(value) * 2 for name, value in request.items()}
        body = await request.json()  # HTTP: the engine's JSON tensor protocol
        inputs = decode_json_tensors(body["inputs"])
        return {"outputs": encode_json_tensors({name: value * 2 for name, value in inputs.items()})}


@pytest.fixture(scope="module")
def local_serve() -> Iterator[int]:
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(Doubler.bind(), name="doubler-app", route_prefix="/double")
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def test_json_tensor_protocol_round_trips() -> None:
    arrays = {"x": np.arange(6, dtype=np.int32).reshape(2, 3)}
    back = decode_json_tensors(encode_json_tensors(arrays))
    np.testing.assert_array_equal(back["x"], arrays["x"])
    assert back["x"].dtype == np.int32
    with pytest.raises(ValueError, match="tensor 'x'"):
        decode_json_tensors({"x": {"dtype": "float32"}})


def _engine(config: dict[str, Any]) -> Any:
    spec = parse_config("ray-double", Path("."), {"backend": "ray_serve", "deployment": "Doubler", **config})
    return engine_class("ray_serve")(spec, EngineContext(device="cpu"))


def test_deployment_handle(local_serve: int) -> None:
    engine = _engine({"app_name": "doubler-app", "address": "auto"})
    engine.load()
    x = np.array([[1.0, 2.5]], dtype=np.float32)
    np.testing.assert_array_equal(engine.infer({"x": x})["x"], x * 2)
    engine.unload()


def test_http_route(local_serve: int) -> None:
    engine = _engine({"route": f"http://127.0.0.1:{local_serve}/double"})
    engine.load()
    x = np.array([3, 4], dtype=np.int64)
    out = engine.infer({"x": x})
    np.testing.assert_array_equal(out["x"], x * 2)
    assert out["x"].dtype == np.int64
    engine.unload()
    broken = _engine({"route": f"http://127.0.0.1:{local_serve}/missing"})
    broken.load()
    with pytest.raises(RuntimeError, match="answered 404"):
        broken.infer({"x": x})


def test_needs_an_address_or_a_route() -> None:
    with pytest.raises(ModelConfigError, match="needs `address` or `route`"):
        _engine({}).load()
