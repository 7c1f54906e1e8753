"""Generate the example torch models, reproducibly (fixed seeds), with nothing downloaded.

    python examples/make_models.py                 # every model, into examples/models/<name>/artifacts/
    python examples/make_models.py policy          # just one
    python examples/make_models.py --root DIR      # another repository folder (tests use tmp dirs)

Each model also gets `artifacts/reference.npz`: a fixed input and the output the saved
artifact computes for it, keyed `input.<name>` and `output.<name>`, so end-to-end
tests can check answers (compare with a small tolerance: thread counts change the
order of float sums).

    policy      TorchScript MLP        state float32 [B, 32]        -> action float32 [B, 8]
    policy-onnx the same MLP, same weights, exported with torch.onnx.export (dynamic batch)
    classifier  torch.export (.pt2)    image uint8 [480, 640, 3]    -> logits float32 [10]
                                        (normalises inside the model)
    tiny-chat   a Hugging Face folder   random-weight Llama (2 layers, hidden 128) with a
                                        byte-level BPE tokenizer trained on a frozen copy of
                                        the repo's docs (models/tiny-chat/tokenizer_corpus.json)
                                        and a chat template (backend: transformers)
    tiny-chat-b the same shape and tokenizer, other random weights (a second LLM for ladders)
    tiny-think  tiny-chat's weights and tokenizer with no chat template in the folder: its
                config.yaml gives one (chat_template.jinja) that reads `enable_thinking`
    tiny-diffusion  a diffusers folder   random-weight UNet2DModel (channels 8/16, no attention)
                                        with a DDIM scheduler (backend: diffusers)
    tiny-sd     a StableDiffusionPipeline folder: random-weight CLIP text encoder (2 layers) and
                byte-level tokenizer, UNet2DConditionModel with cross-attention, AutoencoderKL,
                DDIM scheduler (backend: diffusers): the prompt changes the picture
    tiny-embed  a Hugging Face folder   random-weight BERT encoder (2 layers, hidden 64) with
                                        tiny-chat's tokenizer (backend: embedding)
    tiny-vlm    a Hugging Face folder   random-weight LLaVA (CLIP tower on 32x32 images, tiny-chat's
                                        Llama shape), tiny-chat's tokenizer + <image>, a LLaVA
                                        processor (backend: transformers_vlm)
"""

from __future__ import annotations

import argparse
import functools
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent / "models"


class PolicyMLP(nn.Module):
    def __init__(self, state_dim: int = 32, action_dim: int = 8, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(state_dim, hidden),
            nn.Tanh(),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Linear(hidden, action_dim),
        )

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.net(state))


class SmallCNN(nn.Module):
    """uint8 HWC image -> 10 logits; ImageNet-style normalisation happens inside."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255.0)
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255.0)
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, kernel_size=5, stride=4, padding=2),
            nn.ReLU(),
            nn.Conv2d(8, 16, kernel_size=3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, kernel_size=3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(32, classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = image.permute(2, 0, 1).unsqueeze(0).to(torch.float32)
        x = (x - self.mean) / self.std
        return self.head(self.features(x).flatten(1)).squeeze(0)


def _write_reference(folder: Path, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
    arrays = {f"input.{k}": v for k, v in inputs.items()} | {f"output.{k}": v for k, v in outputs.items()}
    np.savez_compressed(folder / "artifacts" / "reference.npz", **arrays)


def build_policy(folder: Path) -> Path:
    torch.manual_seed(0)
    model = PolicyMLP().eval()
    artifact = folder / "artifacts" / "policy.pt"
    artifact.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.script(model).save(str(artifact))
    state = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    loaded = torch.jit.load(str(artifact), map_location="cpu").eval()
    with torch.inference_mode():
        action = loaded(torch.from_numpy(state)).numpy()
    _write_reference(folder, {"state": state}, {"action": action})
    return artifact


def build_policy_onnx(folder: Path) -> Path:
    """`policy` as ONNX: the same seed, so the same weights and the same answers."""
    torch.manual_seed(0)
    model = PolicyMLP().eval()
    artifact = folder / "artifacts" / "policy.onnx"
    artifact.parent.mkdir(parents=True, exist_ok=True)
    example = torch.zeros((1, 32), dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", DeprecationWarning
        )  # the TorchScript-based exporter: no onnxscript needed
        torch.onnx.export(
            model,
            (example,),
            str(artifact),
            input_names=["state"],
            output_names=["action"],
            dynamic_axes={"state": {0: "batch"}, "action": {0: "batch"}},
            opset_version=17,
            dynamo=False,
        )
    import onnxruntime as ort

    state = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    session = ort.InferenceSession(str(artifact), providers=["CPUExecutionProvider"])
    (action,) = session.run(["action"], {"state": state})
    _write_reference(folder, {"state": state}, {"action": np.asarray(action)})
    return artifact


def _test_image() -> np.ndarray:
    """A fixed 480x640 RGB test image (gradients and stripes: deterministic, compresses well)."""
    rows = np.arange(480, dtype=np.int64)[:, None]
    cols = np.arange(640, dtype=np.int64)[None, :]
    red = rows * 255 // 479 + 0 * cols
    green = cols * 255 // 639 + 0 * rows
    blue = np.where(((rows // 40) + (cols // 40)) % 2 == 0, 200, 40)
    return np.stack([red, green, blue], axis=-1).astype(np.uint8)


def build_classifier(folder: Path) -> Path:
    torch.manual_seed(0)
    model = SmallCNN().eval()
    artifact = folder / "artifacts" / "classifier.pt2"
    artifact.parent.mkdir(parents=True, exist_ok=True)
    example = torch.zeros((480, 640, 3), dtype=torch.uint8)
    with torch.no_grad():
        program = torch.export.export(model, (example,))
    program.example_inputs = None  # else the 900 KB example image is saved with the program
    torch.export.save(program, str(artifact))
    image = _test_image()
    loaded = torch.export.load(str(artifact)).module()
    with torch.inference_mode():
        logits = loaded(torch.from_numpy(image)).numpy()
    _write_reference(folder, {"image": image}, {"logits": logits})
    return artifact


# tiny-chat: the chat markers are special tokens; `</s>` is also what ends a turn.
TINY_CHAT_SPECIAL = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
TINY_CHAT_VOCAB = 1024
# The chat template, as transformers writes it to chat_template.jinja: Hermes-style tools (a
# system turn lists them in <tools>, calls are <tool_call> JSON, results come back in `tool`
# turns as <tool_response>). A chat without tools renders exactly as it did before tools
# (so earlier prompts keep their tokens). tiny-chat's config.yaml says `tool_format: hermes`.
TINY_CHAT_TEMPLATE = """{{ bos_token }}
{%- if tools %}
{{- '<|system|>' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}
{{- 'You may call one or more functions. Their signatures are in <tools></tools>:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\nFor each call, write a JSON object with the function name and arguments within '
    + '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    + '<args-json-object>}\n</tool_call>' + eos_token }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and tools and loop.first %}
{%- elif message['role'] == 'assistant' and message.tool_calls %}
{{- '<|assistant|>' + (message['content'] or '') }}
{%- for call in message.tool_calls %}
{{- '<tool_call>\n{"name": "' + call['function']['name'] + '", "arguments": '
    + (call['function']['arguments'] | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- eos_token }}
{%- elif message['role'] == 'tool' %}
{{- '<|tool|><tool_response>\n' + message['content'] + '\n</tool_response>' + eos_token }}
{%- else %}
{{- '<|' + message['role'] + '|>' + message['content'] + eos_token }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"""


def _tokenizer_corpus() -> list[str]:
    """The texts tiny-chat's tokenizer is trained on: a frozen snapshot of the repo's docs (the
    top README, docs/ and the service READMEs as of 2026-11-25), in a fixed order. Frozen, so
    editing the docs never changes the model a fresh clone builds (tests compare its outputs)."""
    corpus = Path(__file__).resolve().parent / "models" / "tiny-chat" / "tokenizer_corpus.json"
    texts = json.loads(corpus.read_text(encoding="utf-8"))
    assert isinstance(texts, list) and all(isinstance(text, str) for text in texts)
    return texts


def _tiny_tokenizer() -> Any:
    """tiny-chat's byte-level BPE (1,024 tokens, trained on the frozen docs corpus)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_CHAT_VOCAB,
        special_tokens=TINY_CHAT_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def build_tiny_chat(folder: Path, *, seed: int = 0, template: bool = True) -> Path:
    """A tiny random-weight Llama saved as a normal Hugging Face folder (gibberish, real path);
    without `template`, the folder has no chat template (its config.yaml must give one)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    artifact = folder / "artifacts"
    artifact.mkdir(parents=True, exist_ok=True)
    tokenizer = _tiny_tokenizer()
    if template:
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(artifact)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=0.1,  # larger than the default 0.02, so greedy output varies
        dtype="float32",
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(artifact)
    # save_pretrained leaves the weights 0600; the services' own user in the containers
    # (compose mounts examples/ read-only) must read them too.
    (artifact / "model.safetensors").chmod(0o644)
    return artifact / "model.safetensors"


# tiny-vlm's chat template: tiny-chat's, with a message's content either a string or a list
# of parts ({"type": "image"} becomes the processor's <image> marker, text parts their text).
TINY_VLM_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tiny_vlm(folder: Path) -> Path:
    """A tiny random-weight LLaVA (a 2-layer CLIP vision tower on 32x32 images in 8x8 patches,
    a projector, and tiny-chat's shape of Llama) with tiny-chat's tokenizer plus an `<image>`
    token, and a LLaVA processor (each image: 16 image tokens). Saved as a normal Hugging Face
    folder; built from transformers' own classes and seed 0 (gibberish, the real image path)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        CLIPVisionConfig,
        GenerationConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    artifact = folder / "artifacts"
    artifact.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_CHAT_VOCAB,
        special_tokens=[*TINY_CHAT_SPECIAL, "<image>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
    )
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        chat_template=TINY_VLM_TEMPLATE,
        image_token="<image>",
        num_additional_image_tokens=1,  # CLIP's class token, which "default" drops
    )
    processor.save_pretrained(artifact)

    torch.manual_seed(0)
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
            projection_dim=64,
        ),
        text_config=LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
            initializer_range=0.1,  # as tiny-chat: so greedy output varies
        ),
        image_token_id=image_token,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        dtype="float32",
    )
    model = LlavaForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(artifact)
    (artifact / "model.safetensors").chmod(0o644)
    return artifact / "model.safetensors"


def build_tiny_embed(folder: Path) -> Path:
    """A tiny random-weight BERT encoder (2 layers, hidden 64) with tiny-chat's tokenizer, saved
    as a Hugging Face folder: an embedding model (backend: embedding, mean pooling)."""
    from transformers import BertConfig, BertModel

    artifact = folder / "artifacts"
    artifact.mkdir(parents=True, exist_ok=True)
    tokenizer = _tiny_tokenizer()
    tokenizer.save_pretrained(artifact)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
    )
    BertModel(config, add_pooling_layer=False).eval().save_pretrained(artifact)
    (artifact / "model.safetensors").chmod(0o644)  # as tiny-chat's: read by the containers' user
    return artifact / "model.safetensors"


def build_tiny_diffusion(folder: Path) -> Path:
    """A tiny random-weight unconditional UNet with a DDIM scheduler, saved as a diffusers
    pipeline folder (noise-like images, the real diffusion path; a few steps on CPU)."""
    from diffusers import DDIMPipeline, DDIMScheduler, UNet2DModel

    artifact = folder / "artifacts"
    torch.manual_seed(0)
    unet = UNet2DModel(
        sample_size=64,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
        add_attention=False,  # attention over every pixel is what makes big sizes slow
    )
    DDIMPipeline(unet=unet.eval(), scheduler=DDIMScheduler(num_train_timesteps=1000)).save_pretrained(
        artifact
    )
    return artifact / "unet" / "diffusion_pytorch_model.safetensors"


def _byte_level_clip_tokenizer() -> Any:
    """A CLIP tokenizer whose vocabulary is CLIP's 256 byte symbols (each also as a word end)
    and its two special tokens, with no merges: every character is a token. Built here, so
    nothing is downloaded; any text tokenizes, and two prompts differ wherever their text does."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(symbols)}
    vocab.update({symbol + "</w>": len(symbols) + index for index, symbol in enumerate(symbols)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def build_tiny_sd(folder: Path) -> Path:
    """A tiny random-weight text-to-image Stable Diffusion pipeline (fixed seed, nothing
    downloaded): a 2-layer CLIP text encoder, a UNet2DConditionModel that reads the prompt
    through cross-attention at its lower resolution, an AutoencoderKL with a latent 8x smaller
    than the image (as Stable Diffusion's), and a DDIM scheduler."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    artifact = folder / "artifacts"
    torch.manual_seed(0)
    tokenizer = _byte_level_clip_tokenizer()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    unet = UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=4,
        norm_num_groups=4,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=64,
    )
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    pipeline = StableDiffusionPipeline(
        vae=vae.eval(),
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        unet=unet.eval(),
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipeline.save_pretrained(artifact)
    for weights in artifact.rglob("*.safetensors"):
        weights.chmod(0o644)  # the services' own user in the containers reads them too
    return artifact / "unet" / "diffusion_pytorch_model.safetensors"


BUILDERS: dict[str, Callable[[Path], Path]] = {
    "policy": build_policy,
    "policy-onnx": build_policy_onnx,
    "classifier": build_classifier,
    "tiny-chat": build_tiny_chat,
    # tiny-chat's shape and tokenizer, other random weights: a second LLM for model ladders.
    "tiny-chat-b": functools.partial(build_tiny_chat, seed=1),
    # tiny-chat without a chat template of its own: config.yaml names chat_template.jinja.
    "tiny-think": functools.partial(build_tiny_chat, template=False),
    "tiny-diffusion": build_tiny_diffusion,
    "tiny-sd": build_tiny_sd,
    "tiny-embed": build_tiny_embed,
    "tiny-vlm": build_tiny_vlm,
}


def build(names: list[str] | None = None, *, root: Path = ROOT) -> list[Path]:
    """Build the named models (default: all) under `root/<name>/artifacts/`."""
    artifacts = []
    for name in names or list(BUILDERS):
        if name not in BUILDERS:
            raise SystemExit(f"unknown model {name!r} (known: {', '.join(BUILDERS)})")
        artifacts.append(BUILDERS[name](root / name))
    return artifacts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("names", nargs="*", help=f"models to build (default: {' '.join(BUILDERS)})")
    parser.add_argument("--root", type=Path, default=ROOT, help="model repository folder")
    args = parser.parse_args(argv)
    for artifact in build(args.names, root=args.root):
        print(f"wrote {artifact} ({artifact.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
