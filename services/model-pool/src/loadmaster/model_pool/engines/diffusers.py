"""Diffusers engine: a diffusion pipeline folder that turns a request into PNG images.

The folder is what `DiffusionPipeline.save_pretrained` writes (`model_index.json`, `unet/`,
`scheduler/`): an unconditional UNet (`UNet2DModel`) with a DDPM or DDIM scheduler, as
`make models` builds for `tiny-diffusion`. The engine runs the denoising loop itself rather
than the pipeline's `__call__`, because unconditional pipelines only make images of the
UNet's `sample_size`; the UNet is convolutional, so any size whose sides divide by its
downsampling factor works, and the image comes out exactly the size asked for.

Tensors (the gateway's `/v1/images/generations` builds them; any v2 client may too):

    prompt  BYTES [1]   UTF-8 text (an unconditional UNet does not read it; it is checked)
    size    INT32 [2]   width, height: one of the config's `sizes`
    n       INT32 [1]   images to make, 1..max_images
    seed    INT64 [1]   the noise seed; < 0 draws one at random
    ->
    images  BYTES [n]   PNG files, RGB, width x height

Like every engine it runs on the model's own executor thread, never the event loop; the
PNG encoding happens there too. Run with `max_batch_size: 1` (the default): requests of
different sizes cannot share a batch.
"""

from __future__ import annotations

import gc
import io
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.model_pool.engines.base import Engine, EngineContext
from loadmaster.model_pool.repository import DiffusersModelConfig, ModelConfigError, ModelSpec

__all__ = ["DiffusersEngine", "parse_size"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin")
MAX_PROMPT_BYTES = 32 << 10


def _config(spec: ModelSpec) -> DiffusersModelConfig:
    assert isinstance(spec.config, DiffusersModelConfig)
    return spec.config


def _folder(spec: ModelSpec) -> Path:
    folder = spec.path(_config(spec).path)
    if not (folder / "model_index.json").is_file():
        raise ModelConfigError(
            f"model '{spec.model_id}': no diffusers pipeline (model_index.json) in {folder} "
            "(example models: `make models`)"
        )
    return folder


def parse_size(size: str) -> tuple[int, int]:
    """`"WIDTHxHEIGHT"` -> (width, height)."""
    width, _, height = size.partition("x")
    return int(width), int(height)


def _scalar(inputs: Mapping[str, np.ndarray], name: str, kinds: str) -> int:
    array = inputs.get(name)
    if array is None:
        raise InvalidArgumentError(f"input '{name}' is required")
    if array.dtype.kind not in kinds or array.size != 1:
        raise InvalidArgumentError(f"input '{name}': one integer, got {array.dtype.name} {list(array.shape)}")
    return int(array.reshape(-1)[0])


class DiffusersEngine(Engine):
    backend = "diffusers"

    def __init__(self, spec: ModelSpec, context: EngineContext) -> None:
        super().__init__(spec, context)
        config = _config(spec)
        self._sizes = frozenset(parse_size(size) for size in config.sizes)
        self._steps = config.steps
        self._max_images = config.max_images
        self._device = torch.device(context.device)
        self._unet: Any = None
        self._scheduler: Any = None

    @classmethod
    def artifact_files(cls, spec: ModelSpec) -> Iterable[Path]:
        folder = _folder(spec)
        return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)

    # ---- lifecycle ------------------------------------------------------

    def load(self) -> None:
        from diffusers import DiffusionPipeline, UNet2DModel

        folder = _folder(self.spec)
        if self.context.threads and torch.get_num_threads() != self.context.threads:
            torch.set_num_threads(self.context.threads)
        if self._device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {self._device} requested but CUDA is not available")
        pipeline = DiffusionPipeline.from_pretrained(str(folder), local_files_only=True)
        unet: Any = getattr(pipeline, "unet", None)
        scheduler = getattr(pipeline, "scheduler", None)
        if not _is_instance(unet, UNet2DModel) or scheduler is None:
            raise ModelConfigError(
                f"model '{self.spec.model_id}': {folder} is a {type(pipeline).__name__}; the diffusers "
                "engine runs unconditional UNet2DModel pipelines (DDPM/DDIM)"
            )
        factor = 2 ** (len(unet.config.block_out_channels) - 1)
        odd = sorted(f"{w}x{h}" for w, h in self._sizes if w % factor or h % factor)
        if odd:
            raise ModelConfigError(
                f"model '{self.spec.model_id}': sizes {', '.join(odd)} do not divide by the UNet's "
                f"downsampling factor {factor}"
            )
        self._unet = unet.to(self._device).eval()
        self._scheduler = scheduler

    def warmup(self) -> None:
        if not self.spec.config.warmup:
            return
        width, height = min(self._sizes)
        self.infer(
            {
                "prompt": np.array([b"warmup"], dtype=object),
                "size": np.array([width, height], dtype=np.int32),
                "n": np.array([1], dtype=np.int32),
                "seed": np.array([0], dtype=np.int64),
            }
        )

    def unload(self) -> None:
        self._unet = None
        self._scheduler = None
        gc.collect()
        if self._device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(self._device)
            torch.cuda.empty_cache()

    # ---- inference ------------------------------------------------------

    def _request(self, inputs: Mapping[str, np.ndarray]) -> tuple[int, int, int, int]:
        prompt = inputs.get("prompt")
        if prompt is None or prompt.dtype != object or prompt.size != 1:
            raise InvalidArgumentError("input 'prompt': one BYTES element (UTF-8 text) per request")
        text = prompt.reshape(-1)[0]
        if not isinstance(text, bytes | bytearray) or len(text) > MAX_PROMPT_BYTES:
            raise InvalidArgumentError(f"input 'prompt': UTF-8 text of at most {MAX_PROMPT_BYTES} bytes")
        size = inputs.get("size")
        if size is None or size.dtype.kind not in "iu" or size.shape != (2,):
            raise InvalidArgumentError("input 'size': INT32 [2] (width, height)")
        width, height = int(size[0]), int(size[1])
        if (width, height) not in self._sizes:
            known = ", ".join(f"{w}x{h}" for w, h in sorted(self._sizes))
            raise InvalidArgumentError(
                f"size {width}x{height} is not supported by model '{self.spec.model_id}' (sizes: {known})"
            )
        n = _scalar(inputs, "n", "iu")
        if not 1 <= n <= self._max_images:
            raise InvalidArgumentError(
                f"n: {n} images asked, model '{self.spec.model_id}' makes 1..{self._max_images}"
            )
        seed = _scalar(inputs, "seed", "iu") if "seed" in inputs else -1
        if seed < 0:
            seed = secrets.randbits(63)
        return width, height, n, seed

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        unet, scheduler = self._unet, self._scheduler
        if unet is None:
            raise RuntimeError(f"model '{self.spec.model_id}' is not loaded")
        width, height, n, seed = self._request(inputs)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        shape = (n, unet.config.in_channels, height, width)
        with torch.inference_mode():
            sample = torch.randn(shape, generator=generator).to(self._device)
            scheduler.set_timesteps(self._steps)
            for step in scheduler.timesteps:
                noise = unet(sample, step).sample
                sample = scheduler.step(noise, step, sample, generator=generator).prev_sample
            scaled = ((sample / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
            pixels = scaled.permute(0, 2, 3, 1).cpu().numpy()  # NCHW -> NHWC
        images = np.empty((n,), dtype=object)
        for index in range(n):
            images[index] = _png(pixels[index])
        return {"images": images}


def _is_instance(value: Any, cls: type) -> bool:
    return isinstance(value, cls)  # a helper, so `value` stays `Any` for the type checker


def _png(pixels: np.ndarray) -> bytes:
    """One HWC uint8 image (1 or 3 channels) as a PNG file."""
    image = Image.fromarray(pixels[:, :, 0] if pixels.shape[2] == 1 else pixels)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
