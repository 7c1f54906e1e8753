"""The diffusers engine on CPU with `tiny-diffusion` built in a temp folder (examples/make_models.py).

Real parts: diffusers' own pipeline loading, UNet and DDIM scheduler; the PNGs are decoded
with Pillow. 64x64 and a few steps, so the module runs in seconds.
"""

from __future__ import annotations

import importlib.util
import io
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.model_pool.engines import EngineContext, engine_class
from loadmaster.model_pool.engines.diffusers import DiffusersEngine
from loadmaster.model_pool.repository import (
    DiffusersModelConfig,
    ModelConfigError,
    ModelRepository,
    parse_config,
)

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"


def load_make_models() -> Any:
    spec = importlib.util.spec_from_file_location("_lm_make_models_diffusion", EXAMPLES / "make_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny") / "models"
    (root / "tiny-diffusion").mkdir(parents=True)
    shutil.copy(
        EXAMPLES / "models" / "tiny-diffusion" / "config.yaml", root / "tiny-diffusion" / "config.yaml"
    )
    load_make_models().build(["tiny-diffusion"], root=root)
    return root


@pytest.fixture(scope="module")
def engine(tiny_repo: Path) -> Iterator[DiffusersEngine]:
    spec = ModelRepository(tiny_repo).spec("tiny-diffusion")
    assert isinstance(spec.config, DiffusersModelConfig)
    cls = engine_class("diffusers")
    assert cls is DiffusersEngine
    instance = DiffusersEngine(spec, EngineContext(device="cpu", threads=1))
    instance.load()
    instance.warmup()
    yield instance
    instance.unload()


def inputs(
    *, width: int = 64, height: int = 64, n: int = 1, seed: int = 3, prompt: bytes = b"a cat"
) -> dict[str, Any]:
    return {
        "prompt": np.array([prompt], dtype=object),
        "size": np.array([width, height], dtype=np.int32),
        "n": np.array([n], dtype=np.int32),
        "seed": np.array([seed], dtype=np.int64),
    }


def decode(png: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG"
    return image


def test_it_makes_n_pngs_of_exactly_the_size_asked(engine: DiffusersEngine) -> None:
    images = engine.infer(inputs(width=128, height=128, n=2))["images"]
    assert images.dtype == object and images.shape == (2,)
    decoded = [decode(png) for png in images]
    assert [(image.size, image.mode) for image in decoded] == [((128, 128), "RGB")] * 2
    assert decoded[0].tobytes() != decoded[1].tobytes()  # two draws of noise, two pictures
    assert len(set(np.asarray(decoded[0]).reshape(-1).tolist())) > 16  # not a flat image


def test_a_seed_reproduces_the_image_and_another_seed_does_not(engine: DiffusersEngine) -> None:
    first = engine.infer(inputs(seed=11))["images"][0]
    assert engine.infer(inputs(seed=11))["images"][0] == first
    assert engine.infer(inputs(seed=12))["images"][0] != first
    assert decode(engine.infer(inputs(seed=-1))["images"][0]).size == (64, 64)  # < 0: a random seed


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"width": 100, "height": 64}, "size 100x64"),
        ({"width": 1024, "height": 1024}, "size 1024x1024"),
        ({"n": 0}, "n:"),
        ({"n": 5}, "n:"),
    ],
)
def test_bad_requests_are_invalid_argument_naming_the_field(
    engine: DiffusersEngine, change: dict[str, int], named: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=named):
        engine.infer(inputs(**change))


def test_malformed_tensors_are_refused(engine: DiffusersEngine) -> None:
    bad_prompt = inputs() | {"prompt": np.array([b"a", b"b"], dtype=object)}
    with pytest.raises(InvalidArgumentError, match="prompt"):
        engine.infer(bad_prompt)
    with pytest.raises(InvalidArgumentError, match="size"):
        engine.infer(inputs() | {"size": np.array([64.0, 64.0], dtype=np.float32)})
    with pytest.raises(InvalidArgumentError, match="'n'"):
        engine.infer({k: v for k, v in inputs().items() if k != "n"})


def test_sizes_the_unet_cannot_make_are_a_config_error(tiny_repo: Path) -> None:
    folder = tiny_repo / "tiny-diffusion"
    spec = parse_config("odd", folder, {"backend": "diffusers", "path": "artifacts", "sizes": ["63x63"]})
    with pytest.raises(ModelConfigError, match="63x63"):
        DiffusersEngine(spec, EngineContext(device="cpu")).load()
    with pytest.raises(ModelConfigError, match="WIDTHxHEIGHT"):
        parse_config("bad", folder, {"backend": "diffusers", "sizes": ["64 by 64"]})


def test_the_lease_estimate_comes_from_the_weights(tiny_repo: Path) -> None:
    spec = ModelRepository(tiny_repo).spec("tiny-diffusion")
    files = list(DiffusersEngine.artifact_files(spec))
    assert [f.name for f in files] == ["diffusion_pytorch_model.safetensors"]
    assert DiffusersEngine.estimate_mb(spec) >= 1
