"""Text-conditioned pipelines in the diffusers engine, on CPU: `tiny-sd` as `make models` builds
it (StableDiffusionPipeline), and tiny random SDXL, SD3 and FLUX pipelines built here from
diffusers' and transformers' classes (fixed seeds, nothing downloaded). Each loads by its own
model_index.json; the same seed and prompt give the same PNGs, another prompt other PNGs."""

from __future__ import annotations

import importlib.util
import io
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.model_pool.engines import EngineContext
from loadmaster.model_pool.engines.diffusers import DiffusersEngine
from loadmaster.model_pool.repository import ModelConfigError, ModelRepository

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"


def _make_models() -> Any:
    spec = importlib.util.spec_from_file_location("_lm_make_models_sd", EXAMPLES / "make_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKE_MODELS = _make_models()


# ---- tiny random pipelines of the other classes ----------------------------------------------


def _clip(tokenizer: Any, *, projection: bool = False) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        projection_dim=32,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def _vae(*, shift: float | None = None) -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(8, 16),
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=4,
        layers_per_block=1,
        sample_size=32,
        shift_factor=shift,
    ).eval()


def _t5() -> tuple[Any, Any]:
    """A T5 tokenizer over single letters (a unigram vocabulary made here) and a 2-layer encoder."""
    from transformers import T5Config, T5EncoderModel, T5Tokenizer

    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + c, -1.0) for c in letters] + [(c, -2.0) for c in letters]
    tokenizer = T5Tokenizer(vocab=pieces, extra_ids=0)
    config = T5Config(
        vocab_size=len(tokenizer), d_model=32, d_ff=37, d_kv=8, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8,
    )  # fmt: skip
    return tokenizer, T5EncoderModel(config).eval()


def build_sdxl(folder: Path) -> None:
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    torch.manual_seed(0)
    tokenizer = MAKE_MODELS._byte_level_clip_tokenizer()
    unet = UNet2DConditionModel(
        block_out_channels=(16, 32), layers_per_block=1, sample_size=16, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=4, use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, projection_class_embeddings_input_dim=80, cross_attention_dim=64,
        norm_num_groups=4,
    ).eval()  # fmt: skip
    scheduler = EulerDiscreteScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    StableDiffusionXLPipeline(
        vae=_vae(), text_encoder=_clip(tokenizer), text_encoder_2=_clip(tokenizer, projection=True),
        tokenizer=tokenizer, tokenizer_2=tokenizer, unet=unet, scheduler=scheduler,
    ).save_pretrained(folder)  # fmt: skip


def build_sd3(folder: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(0)
    tokenizer = MAKE_MODELS._byte_level_clip_tokenizer()
    t5_tokenizer, t5 = _t5()
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=4,
        caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4,
    ).eval()  # fmt: skip
    StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), vae=_vae(shift=0.0),
        text_encoder=_clip(tokenizer, projection=True), tokenizer=tokenizer,
        text_encoder_2=_clip(tokenizer, projection=True), tokenizer_2=tokenizer,
        text_encoder_3=t5, tokenizer_3=t5_tokenizer,
    ).save_pretrained(folder)  # fmt: skip


def build_flux(folder: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(0)
    tokenizer = MAKE_MODELS._byte_level_clip_tokenizer()
    t5_tokenizer, t5 = _t5()
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
    ).eval()  # fmt: skip
    FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=_vae(shift=0.0), text_encoder=_clip(tokenizer),
        tokenizer=tokenizer, text_encoder_2=t5, tokenizer_2=t5_tokenizer, transformer=transformer,
    ).save_pretrained(folder)  # fmt: skip


def build_tiny_sd(folder: Path) -> None:
    MAKE_MODELS.build_tiny_sd(folder.parent)  # writes <folder.parent>/artifacts


# ---- the engine --------------------------------------------------------------------------------

CONFIG = 'backend: diffusers\npath: artifacts\nsteps: 2\nsizes: ["64x64", "128x64"]\nmax_images: 2\n'


def engine_for(root: Path, name: str, build: Callable[[Path], None], config: str = CONFIG) -> DiffusersEngine:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(config)
    if not (folder / "artifacts" / "model_index.json").exists():
        build(folder / "artifacts")
    engine = DiffusersEngine(ModelRepository(root).spec(name), EngineContext(device="cpu", threads=1))
    engine.load()
    return engine


def inputs(prompt: str, *, seed: int = 11, n: int = 1, width: int = 64, height: int = 64) -> dict[str, Any]:
    return {
        "prompt": np.array([prompt.encode()], dtype=object),
        "size": np.array([width, height], dtype=np.int32),
        "n": np.array([n], dtype=np.int32),
        "seed": np.array([seed], dtype=np.int64),
    }


def pixels(png: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG" and image.mode == "RGB"
    return np.asarray(image)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("text-to-image")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize(
    ("name", "build", "kind"),
    [
        ("tiny-sd", build_tiny_sd, "StableDiffusionPipeline"),
        ("sdxl", build_sdxl, "StableDiffusionXLPipeline"),
        ("sd3", build_sd3, "StableDiffusion3Pipeline"),
        ("flux", build_flux, "FluxPipeline"),
    ],
)
def test_the_prompt_changes_the_image_and_a_seed_reproduces_it(
    root: Path, name: str, build: Callable[[Path], None], kind: str
) -> None:
    engine = engine_for(root, name, build)
    try:
        assert type(engine._pipeline).__name__ == kind
        first = engine.infer(inputs("a lighthouse at dusk"))["images"]
        again = engine.infer(inputs("a lighthouse at dusk"))["images"]
        other = engine.infer(inputs("a red cat on a mat"))["images"]
        assert first[0] == again[0]  # the same seed and prompt: the same PNG, byte for byte
        assert first[0] != other[0]
        assert (
            np.abs(pixels(first[0]).astype(int) - pixels(other[0])).mean() > 0.1
        )  # not one pixel: the picture
        two = engine.infer(inputs("a lighthouse at dusk", n=2, width=128))["images"]
        assert [pixels(png).shape for png in two] == [(64, 128, 3)] * 2 and two[0] != two[1]
        assert engine.infer(inputs("a lighthouse at dusk", seed=12))["images"][0] != first[0]
    finally:
        engine.unload()


def test_requests_a_text_pipeline_cannot_take_are_refused_naming_the_field(root: Path) -> None:
    engine = engine_for(root, "tiny-sd", build_tiny_sd)
    try:
        with pytest.raises(InvalidArgumentError, match="size 32x32 is not supported"):
            engine.infer(inputs("x", width=32, height=32))
        with pytest.raises(InvalidArgumentError, match="n: 3 images asked"):
            engine.infer(inputs("x", n=3))
        bad = inputs("x")
        bad["prompt"] = np.array([b"\xff\xfe"], dtype=object)
        with pytest.raises(InvalidArgumentError, match="input 'prompt': not UTF-8 text"):
            engine.infer(bad)
    finally:
        engine.unload()


def test_sizes_that_do_not_fit_the_pipeline_and_other_pipeline_classes_are_refused_at_load(
    root: Path,
) -> None:
    with pytest.raises(
        ModelConfigError, match=r"sizes 72x72 do not divide by the StableDiffusionPipeline's size factor 16"
    ):
        engine_for(root, "tiny-sd", build_tiny_sd, CONFIG.replace('"128x64"', '"72x72"'))

    def image_to_image(folder: Path) -> None:
        from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionPipeline

        source = root / "tiny-sd" / "artifacts"
        components = StableDiffusionPipeline.from_pretrained(str(source), local_files_only=True).components
        StableDiffusionImg2ImgPipeline(**components).save_pretrained(folder)

    with pytest.raises(
        ModelConfigError, match="is a StableDiffusionImg2ImgPipeline; the diffusers engine runs"
    ):
        engine_for(root, "img2img", image_to_image)
