"""Diffusers engine: a diffusion pipeline folder that turns a request into PNG images.

The folder is what `DiffusionPipeline.save_pretrained` writes (`model_index.json` and a
folder per component); its own `model_index.json` names the pipeline class. Two kinds run:

- text-conditioned pipelines (`TEXT_PIPELINES`: Stable Diffusion, SDXL, SD3, FLUX, as
  `make models` builds for `tiny-sd`): the pipeline's own `__call__` with the prompt, the
  size, `steps`, `n` images per prompt, the seeded generator and the config's
  `guidance_scale`; the prompt changes the picture;
- unconditional pipelines (a `UNet2DModel` with a DDPM or DDIM scheduler, as `tiny-diffusion`):
  the engine runs the denoising loop itself rather than the pipeline's `__call__`, because
  unconditional pipelines only make images of the UNet's `sample_size`; the UNet is
  convolutional, so any size whose sides divide by its downsampling factor works, and the
  image comes out exactly the size asked for. The prompt is checked but not read.

Any other pipeline class is refused at load, naming it. Sizes must divide by the pipeline's
factor (latent scale x UNet downsampling, or x patch size), checked at load.

Tensors (the gateway's `/v1/images/generations` builds them; any v2 client may too):

    prompt  BYTES [1]   UTF-8 text
    size    INT32 [2]   width, height: one of the config's `sizes`
    n       INT32 [1]   images to make, 1..max_images
    seed    INT64 [1]   the noise seed; < 0 draws one at random
    ->
    images  BYTES [n]   PNG files, RGB, width x height

Like every engine it runs on the model's own executor thread, never the event loop; the
PNG encoding happens there too. Run with `max_batch_size: 1` (the default): requests of
different sizes cannot share a batch. The same seed, prompt, size and n give the same images
on the same device and library versions.
"""

from __future__ import annotations

import gc
import io
import math
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

__all__ = ["TEXT_PIPELINES", "DiffusersEngine", "parse_size"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin")
MAX_PROMPT_BYTES = 32 << 10
# Text-conditioned pipeline classes run through their own __call__ (prompt -> images).
TEXT_PIPELINES = frozenset(
    {
        "StableDiffusionPipeline",
        "StableDiffusionXLPipeline",
        "StableDiffusion3Pipeline",
        "FluxPipeline",
    }
)


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
        self._guidance_scale = config.guidance_scale
        self._device = torch.device(context.device)
        self._unet: Any = None
        self._scheduler: Any = None
        self._pipeline: Any = None  # a text-conditioned pipeline; None: the unconditional loop

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
        kind = type(pipeline).__name__
        unet: Any = getattr(pipeline, "unet", None)
        scheduler = getattr(pipeline, "scheduler", None)
        if kind in TEXT_PIPELINES:
            factor = _text_size_factor(pipeline)
        elif _is_instance(unet, UNet2DModel) and scheduler is not None:
            factor = 2 ** (len(unet.config.block_out_channels) - 1)
        else:
            raise ModelConfigError(
                f"model '{self.spec.model_id}': {folder} is a {kind}; the diffusers engine runs "
                f"{', '.join(sorted(TEXT_PIPELINES))} and unconditional UNet2DModel pipelines (DDPM/DDIM)"
            )
        odd = sorted(f"{w}x{h}" for w, h in self._sizes if w % factor or h % factor)
        if odd:
            raise ModelConfigError(
                f"model '{self.spec.model_id}': sizes {', '.join(odd)} do not divide by the {kind}'s "
                f"size factor {factor}"
            )
        if kind in TEXT_PIPELINES:
            pipeline.set_progress_bar_config(disable=True)
            self._pipeline = pipeline.to(self._device)
            return
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
        self._pipeline = None
        gc.collect()
        if self._device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(self._device)
            torch.cuda.empty_cache()

    # ---- inference ------------------------------------------------------

    def _request(self, inputs: Mapping[str, np.ndarray]) -> tuple[str, int, int, int, int]:
        prompt = inputs.get("prompt")
        if prompt is None or prompt.dtype != object or prompt.size != 1:
            raise InvalidArgumentError("input 'prompt': one BYTES element (UTF-8 text) per request")
        raw = prompt.reshape(-1)[0]
        if not isinstance(raw, bytes | bytearray) or len(raw) > MAX_PROMPT_BYTES:
            raise InvalidArgumentError(f"input 'prompt': UTF-8 text of at most {MAX_PROMPT_BYTES} bytes")
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgumentError("input 'prompt': not UTF-8 text") from None
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
        return text, width, height, n, seed

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._pipeline is not None:
            return self._from_text(inputs)
        unet, scheduler = self._unet, self._scheduler
        if unet is None:
            raise RuntimeError(f"model '{self.spec.model_id}' is not loaded")
        _, width, height, n, seed = self._request(inputs)
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
        return {"images": _pngs(pixels)}

    def _from_text(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A text-conditioned pipeline's own call: prompt, size, steps, n, the seeded generator."""
        text, width, height, n, seed = self._request(inputs)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        options: dict[str, Any] = {}
        if self._guidance_scale is not None:
            options["guidance_scale"] = self._guidance_scale
        with torch.inference_mode():
            result = self._pipeline(
                prompt=text,
                height=height,
                width=width,
                num_inference_steps=self._steps,
                num_images_per_prompt=n,
                generator=generator,
                output_type="np",
                **options,
            )
        pixels = (np.clip(np.asarray(result.images), 0.0, 1.0) * 255).round().astype(np.uint8)  # NHWC
        return {"images": _pngs(pixels)}


def _text_size_factor(pipeline: Any) -> int:
    """What the sides of an image must divide by: the VAE's scale times the UNet's downsampling
    (SD, SDXL) or the transformer's patch (SD3; FLUX packs 2x2 patches), and at least 8."""
    scale = int(getattr(pipeline, "vae_scale_factor", 8) or 8)
    unet = getattr(pipeline, "unet", None)
    if unet is not None:
        return math.lcm(8, scale * 2 ** (len(unet.config.block_out_channels) - 1))
    transformer = getattr(pipeline, "transformer", None)
    patch = int(getattr(getattr(transformer, "config", None), "patch_size", 1) or 1)
    return math.lcm(8, scale * max(2, patch))


def _pngs(pixels: np.ndarray) -> np.ndarray:
    images = np.empty((pixels.shape[0],), dtype=object)
    for index in range(pixels.shape[0]):
        images[index] = _png(pixels[index])
    return images


def _is_instance(value: Any, cls: type) -> bool:
    return isinstance(value, cls)  # a helper, so `value` stays `Any` for the type checker


def _png(pixels: np.ndarray) -> bytes:
    """One HWC uint8 image (1 or 3 channels) as a PNG file."""
    image = Image.fromarray(pixels[:, :, 0] if pixels.shape[2] == 1 else pixels)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
