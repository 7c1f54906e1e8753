"""The model repository: one folder per model, each with a `config.yaml`.

    models/
      double/    config.yaml  model.py
      policy/    config.yaml  artifacts/policy.pt

`config.yaml` (validated with pydantic; a broken file is an error for that model only):

    backend: torch            # python | python_generative | torch | onnx | tensorrt | ray_serve | transformers
                              # | transformers_vlm | openai_process | remote_openai | diffusers | embedding
    artifact: artifacts/policy.pt   # torch: TorchScript (.pt/.ts) or torch.export (.pt2)
    # module: model.py        # python: the file and the class with load()/infer()
    # class: Double
    device: cuda:0            # optional; default: the worker's `model_pool.device`
    vram_mb: 64               # optional; default: artifact size x 1.3
    warmup: true              # run one zero input at load when every input shape is known
    category: vision          # optional: llm | vision | diffusion | other (default: from the backend)
    keep_alive_s: 120         # optional: idle seconds before unloading (default: the category's)
    inputs:                   # optional; when given, requests are checked against them
      - {name: state, dtype: float32, shape: [-1, 32]}   # -1 = any size
    outputs:                  # inputs and outputs are the model's KServe metadata
      - {name: action, dtype: float32, shape: [-1, 8]}
    # enforce_inputs: false   # describe only: a model that takes any tensors (`double`)

Configs are read again at every load, so an edited file takes effect on the next load.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from loadmaster.common.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError

__all__ = [
    "CATEGORY_BY_BACKEND",
    "CONFIG_FILE",
    "DTYPES",
    "DiffusersModelConfig",
    "ModelConfig",
    "ModelConfigError",
    "ModelRepository",
    "ModelSpec",
    "OnnxModelConfig",
    "OpenAIProcessModelConfig",
    "PythonModelConfig",
    "RayServeModelConfig",
    "RemoteOpenAIModelConfig",
    "TensorRTModelConfig",
    "TensorSpec",
    "TorchModelConfig",
    "TransformersModelConfig",
    "VisionLanguageModelConfig",
    "check_inputs",
    "parse_config",
    "zeros_for",
]

CONFIG_FILE = "config.yaml"

# Config dtype names -> numpy dtypes as they arrive from the wire (bfloat16 travels as uint16 words).
DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "bfloat16": np.dtype(np.uint16),
    "uint8": np.dtype(np.uint8),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "bool": np.dtype(np.bool_),
    "bytes": np.dtype(object),  # KServe BYTES: each element a byte string
}
_MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# A model's category when its config names none (every other backend: "other"). The category
# picks the keep-alive default (models.category_keep_alive_s, docs/ladders.md).
CATEGORY_BY_BACKEND: dict[str, Literal["llm", "vision", "diffusion", "other"]] = {
    "transformers": "llm",
    "transformers_vlm": "llm",
    "openai_process": "llm",
    "remote_openai": "llm",
    "python_generative": "llm",
    "embedding": "llm",  # keep-alive as a language model's
    "diffusers": "diffusion",
}


class ModelConfigError(FailedPreconditionError):
    """A model's folder or `config.yaml` is broken; the model cannot load until it is fixed."""


class TensorSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    dtype: Literal["float16", "float32", "float64", "bfloat16", "uint8", "int32", "int64", "bool", "bytes"]
    shape: tuple[int, ...] | None = None  # None = any shape; -1 = any size on that axis
    # A uint8 [H, W, C] (or [N, H, W, C]) input that also takes compressed images as a BYTES
    # tensor, one JPEG or PNG per element, decoded on the worker (KServe clients; model_pool/images.py).
    image: bool = False

    @field_validator("shape")
    @classmethod
    def _dims(cls, shape: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if shape is not None and any(dim < -1 for dim in shape):
            raise ValueError("dimensions are sizes >= 0, or -1 for any size")
        return shape

    @model_validator(mode="after")
    def _image(self) -> TensorSpec:
        if self.image:
            if self.dtype != "uint8":
                raise ValueError(f"image input '{self.name}' has dtype uint8 (its pixels)")
            if self.shape is not None and (
                len(self.shape) not in (3, 4) or self.shape[-1] not in (-1, 1, 3, 4)
            ):
                raise ValueError(
                    f"image input '{self.name}' has shape [H, W, C] or [N, H, W, C] with C 1, 3, 4 or -1"
                )
        return self

    @property
    def numpy_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    @property
    def fixed_shape(self) -> bool:
        return self.shape is not None and all(dim >= 0 for dim in self.shape)


class _BaseModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    device: str | None = None
    vram_mb: int | None = Field(default=None, ge=0)
    warmup: bool = True
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    # With declared inputs, undeclared request tensors are refused unless this is true.
    allow_extra_inputs: bool = False
    # False: the declared tensors describe the model (KServe metadata, `loadmaster models`,
    # warm-up) but requests are not checked against them, for a model that takes any tensors.
    enforce_inputs: bool = True
    description: str = ""
    # Warm-up inputs: an .npz in the model folder (keys = input names); default: zeros
    # generated from the declared inputs (variable axes = 1) when every shape is declared.
    warmup_inputs: str | None = None
    # Dynamic batching: concurrent requests are stacked on dim 0 up to max_batch_size rows
    # (1 = no batching); the first waits at most max_queue_delay_ms for company.
    max_batch_size: int = Field(default=1, ge=1)
    max_queue_delay_ms: float = Field(default=0.0, ge=0)
    preferred_batch_sizes: tuple[int, ...] = ()
    # Copies of the model, each with its own thread, run batches in parallel.
    instances: int = Field(default=1, ge=1, le=64)
    # What kind of model (None: from the backend, CATEGORY_BY_BACKEND) and how long it may stay
    # loaded while idle (None: models.known.<id>.keep_alive_s, else its category's default).
    category: Literal["llm", "vision", "diffusion", "other"] | None = None
    keep_alive_s: float | None = Field(default=None, gt=0)
    # What GR00T clients get from `get_modality_config` (docs/robot-clients.md): modality name ->
    # GR00T's ModalityConfig fields (delta_indices, modality_keys, ...), passed through as given.
    modality_config: dict[str, dict[str, Any]] | None = None

    @field_validator("preferred_batch_sizes")
    @classmethod
    def _preferred(cls, sizes: tuple[int, ...]) -> tuple[int, ...]:
        if any(size < 1 for size in sizes):
            raise ValueError("preferred batch sizes are >= 1")
        return tuple(sorted(set(sizes)))

    @field_validator("device")
    @classmethod
    def _device(cls, device: str | None) -> str | None:
        if device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", device):
            raise ValueError("device is 'cpu', 'cuda' or 'cuda:N'")
        return device

    @field_validator("inputs", "outputs")
    @classmethod
    def _unique(cls, specs: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
        names = [spec.name for spec in specs]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"duplicate tensor names: {', '.join(duplicates)}")
        return specs


class PythonModuleConfig(_BaseModelConfig):
    """A class in a Python file of the model's folder."""

    module: str = "model.py"
    class_name: str = Field(alias="class", min_length=1)


class PythonModelConfig(PythonModuleConfig):
    backend: Literal["python"]


class PythonGenerativeModelConfig(PythonModuleConfig):
    """A Python class whose `generate(request)` yields text (engines/python_generative.py)."""

    backend: Literal["python_generative"]
    max_sequences: int = Field(default=8, ge=1, le=1024)  # streams generating at once
    # How its text writes tool calls (tool_calls.py, docs/tool-calling.md).
    tool_format: Literal["hermes", "llama", "mistral"] = "hermes"


class TorchModelConfig(_BaseModelConfig):
    backend: Literal["torch"]
    artifact: str = Field(min_length=1)
    # Default from the suffix: .pt2 -> export (torch.export), anything else -> torchscript.
    format: Literal["torchscript", "export"] | None = None

    @property
    def artifact_format(self) -> Literal["torchscript", "export"]:
        if self.format is not None:
            return self.format
        return "export" if self.artifact.endswith(".pt2") else "torchscript"


class OnnxModelConfig(_BaseModelConfig):
    backend: Literal["onnx"]
    artifact: str = Field(min_length=1)
    # ONNX Runtime execution providers in order of preference; default: TensorRT and CUDA
    # first when the device is cuda and the runtime has them, then CPU.
    providers: tuple[str, ...] | None = None


class TensorRTModelConfig(_BaseModelConfig):
    backend: Literal["tensorrt"]
    artifact: str = Field(min_length=1)  # a serialized engine (.plan / .engine)
    profile: int = Field(default=0, ge=0)  # the optimization profile the context uses


class RayServeModelConfig(_BaseModelConfig):
    backend: Literal["ray_serve"]
    deployment: str = Field(min_length=1)  # the deployment (or application ingress) name
    app_name: str = "default"
    route: str | None = None  # HTTP fallback, e.g. http://127.0.0.1:8000/policy
    address: str | None = None  # Ray cluster address ("auto", "ray://host:10001"); None = HTTP only
    timeout_s: float = Field(default=30.0, gt=0)


class TransformersModelConfig(_BaseModelConfig):
    """A Hugging Face causal-LM folder (config.json, safetensors, tokenizer, chat template),
    served with transformers' continuous batching (docs/generative.md)."""

    backend: Literal["transformers"]
    path: str = Field(default=".", min_length=1)  # the HF folder, relative to the model folder
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    max_sequences: int = Field(default=32, ge=1, le=4096)  # sequences in one step's batch
    # Sequences that hold their KV cache and take turns in the steps (the engine picks each
    # step's members: urgent first, then fair between tenants; docs/generation-scheduling.md).
    # Default: max_sequences (every resident sequence runs in every step).
    max_resident_sequences: int | None = Field(default=None, ge=1, le=16384)
    block_size: int = Field(default=256, ge=4)  # tokens per KV-cache page
    # KV-cache pages; the lease adds num_blocks x block_size x per-token KV bytes. Default:
    # enough for the resident sequences' contexts of max_context_tokens, at most 4096 pages.
    num_blocks: int | None = Field(default=None, ge=1)
    max_batch_tokens: int | None = Field(default=None, ge=1)
    max_context_tokens: int | None = Field(default=None, ge=1)  # default: the model's own
    seed: int = 0  # the manager-wide seed (requests without one draw theirs at random)
    # Prefix reuse (docs/prefix-reuse.md): full KV pages of earlier prompts are shared, not
    # recomputed; at most `prefix_cache_max_blocks` pages are kept for reuse alone (LRU;
    # None: all of them until the cache runs short, then transformers drops them all).
    prefix_caching: bool = True
    prefix_cache_max_blocks: int | None = Field(default=None, ge=0)
    # The chat template, for a folder without one (or to replace its own): a file in the model
    # folder (`chat_template.jinja`) or the template itself (text holding `{{` or `{%`).
    chat_template: str | None = Field(default=None, min_length=1)
    # Given to the chat template as `enable_thinking` (templates that read it switch a reasoning
    # block on or off); None: not given. A request's `chat_template_kwargs` overrides it.
    thinking: bool | None = None

    # How the model writes tool calls, as its chat template teaches it (docs/tool-calling.md).
    tool_format: Literal["hermes", "llama", "mistral"] = "hermes"

    @model_validator(mode="after")
    def _resident_holds_a_step(self) -> TransformersModelConfig:
        if self.max_resident_sequences is not None and self.max_resident_sequences < self.max_sequences:
            raise ValueError(
                f"max_resident_sequences ({self.max_resident_sequences}) is below max_sequences "
                f"({self.max_sequences}): every sequence of a step holds its cache"
            )
        return self

    @property
    def resident_sequences(self) -> int:
        return self.max_resident_sequences or self.max_sequences


class VisionLanguageModelConfig(_BaseModelConfig):
    """A Hugging Face image-text-to-text folder (config.json with a vision tower, safetensors,
    the processor's files, chat template), served one token at a time per sequence
    (engines/vision_language.py, docs/dialects.md): no batching, no paged KV cache."""

    backend: Literal["transformers_vlm"]
    path: str = Field(default=".", min_length=1)  # the HF folder, relative to the model folder
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    max_sequences: int = Field(default=4, ge=1, le=64)  # sequences interleaved token by token
    max_context_tokens: int | None = Field(default=None, ge=1)  # default: the model's own
    max_image_pixels: int = Field(default=4096 * 4096, ge=1)  # per image, before resizing
    max_images: int = Field(default=8, ge=1)  # per request


class OpenAIProcessModelConfig(_BaseModelConfig):
    """A model served by an external OpenAI-compatible engine process (llama-server, vLLM,
    SGLang, `transformers serve`) that the worker starts, health-polls, proxies and stops
    (docs/engine-processes.md)."""

    backend: Literal["openai_process"]
    # The engine's command line, a template: {model_path} {port} {host} {gpus} {num_gpus}
    # are filled in (a string is split like a shell would; no shell runs it).
    command: str | tuple[str, ...]
    # {model_path}: relative to the model folder (may point outside it: only the engine reads it).
    path: str = Field(default=".", min_length=1)
    host: str = "127.0.0.1"
    health_path: str = "/health"  # polled until it answers 200; `/v1/models` for engines without /health
    load_timeout_s: float = Field(default=300.0, gt=0)
    stop_grace_s: float = Field(default=10.0, gt=0)  # SIGTERM, then SIGKILL the process group
    # The `model` the engine is asked for; default: the first id its /v1/models lists.
    served_model: str | None = None
    max_sequences: int = Field(default=32, ge=1, le=4096)  # streams sent to the engine at once
    # Send each request's priority as the body's `priority` (vLLM's, with
    # `--scheduling-policy priority`; 0 is the most urgent in both). Off: the engine would
    # refuse a field it does not know (llama-server, `transformers serve`).
    forward_priority: bool = False
    request_timeout_s: float = Field(default=600.0, gt=0)  # longest silence inside one stream
    env: dict[str, str] = Field(default_factory=dict)  # added to the engine's environment

    @field_validator("command")
    @classmethod
    def _command(cls, command: str | tuple[str, ...]) -> str | tuple[str, ...]:
        if not (command.split() if isinstance(command, str) else command):
            raise ValueError("command is empty")
        return command

    @field_validator("instances")
    @classmethod
    def _one_instance(cls, instances: int) -> int:
        if instances != 1:
            raise ValueError("an engine process is one instance (run more workers for more copies)")
        return instances


class RemoteOpenAIModelConfig(_BaseModelConfig):
    """A model served by a hosted OpenAI-compatible API (docs/remote-models.md): the worker
    proxies to it as it does to an engine process, with no process and no GPU lease."""

    backend: Literal["remote_openai"]
    # The API root as the OpenAI SDK takes it (`https://api.openai.com/v1`); http or https.
    base_url: str = Field(pattern=r"^https?://[^\s/]+(/\S*)?$")
    remote_model: str = Field(min_length=1)  # the `model` the API is asked for
    # A file holding the API key (relative to the model folder, or absolute), read at each load;
    # None: no Authorization header (a local server, or a gateway in front that adds one).
    api_key_file: str | None = Field(default=None, min_length=1)
    max_sequences: int = Field(default=32, ge=1, le=4096)  # streams sent to the API at once
    request_timeout_s: float = Field(default=600.0, gt=0)  # longest silence inside one stream
    # At load, GET <base_url>/models must answer 200: a wrong URL or key fails the load (the
    # model is then not READY, so no ladder falls back to it) instead of every request.
    check_on_load: bool = True
    check_timeout_s: float = Field(default=10.0, gt=0)

    @field_validator("vram_mb")
    @classmethod
    def _no_memory(cls, vram_mb: int | None) -> int | None:
        if vram_mb:
            raise ValueError("a remote model holds no GPU memory (leave vram_mb out, or 0)")
        return vram_mb

    @field_validator("device")
    @classmethod
    def _no_device(cls, device: str | None) -> str | None:
        if device is not None:
            raise ValueError("a remote model runs on no device of this worker (leave device out)")
        return device

    @field_validator("instances")
    @classmethod
    def _one_instance(cls, instances: int) -> int:
        if instances != 1:
            raise ValueError("a remote model is one instance (max_sequences sets how many streams)")
        return instances

    @field_validator("base_url")
    @classmethod
    def _no_trailing_slash(cls, base_url: str) -> str:
        return base_url.rstrip("/")


class EmbeddingModelConfig(_BaseModelConfig):
    """A Hugging Face encoder folder served as an embedding model (engines/embedding.py,
    docs/embeddings.md): texts or token ids in, one vector each out, batched like any tensor
    model (`max_batch_size`)."""

    backend: Literal["embedding"]
    path: str = Field(default=".", min_length=1)  # the HF folder, relative to the model folder
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    pooling: Literal["mean", "cls", "last"] = "mean"  # how token states become one vector
    normalize: bool = True  # unit length (cosine similarity is a dot product)
    # Shorter vectors a request may ask for (`dimensions`, Matryoshka-trained models): the
    # first N components, re-normalised. Empty: only the model's own size.
    dimensions: tuple[int, ...] = ()
    max_input_tokens: int | None = Field(default=None, ge=1)  # default: the model's positions

    @field_validator("dimensions")
    @classmethod
    def _dimensions(cls, sizes: tuple[int, ...]) -> tuple[int, ...]:
        if any(size < 1 for size in sizes):
            raise ValueError("dimensions are sizes >= 1")
        return tuple(sorted(set(sizes)))


class DiffusersModelConfig(_BaseModelConfig):
    """A diffusers pipeline folder (its own model_index.json names the class: Stable Diffusion,
    SDXL, SD3, FLUX, or an unconditional UNet) that makes images (engines/diffusers.py,
    docs/images.md)."""

    backend: Literal["diffusers"]
    path: str = Field(default=".", min_length=1)  # the pipeline folder, relative to the model folder
    steps: int = Field(default=4, ge=1, le=1000)  # denoising steps per image
    sizes: tuple[str, ...] = ("64x64", "128x128", "256x256", "512x512")  # WIDTHxHEIGHT it makes
    max_images: int = Field(default=4, ge=1, le=64)  # images per request (OpenAI's `n`)
    # Text-conditioned pipelines: how strongly the prompt steers (classifier-free guidance;
    # > 1 runs the model twice per step). None: the pipeline's own default.
    guidance_scale: float | None = Field(default=None, ge=0, le=50)

    @field_validator("sizes")
    @classmethod
    def _sizes(cls, sizes: tuple[str, ...]) -> tuple[str, ...]:
        for size in sizes:
            if not re.fullmatch(r"[1-9][0-9]{0,4}x[1-9][0-9]{0,4}", size):
                raise ValueError(f"size {size!r} is not WIDTHxHEIGHT")
        return sizes


AnyModelConfig = (
    PythonModelConfig
    | PythonGenerativeModelConfig
    | TorchModelConfig
    | OnnxModelConfig
    | TensorRTModelConfig
    | RayServeModelConfig
    | TransformersModelConfig
    | VisionLanguageModelConfig
    | OpenAIProcessModelConfig
    | RemoteOpenAIModelConfig
    | DiffusersModelConfig
    | EmbeddingModelConfig
)
# One entry per engine; the `backend` field picks the class.
ModelConfig = Annotated[AnyModelConfig, Field(discriminator="backend")]
_CONFIG_ADAPTER: TypeAdapter[AnyModelConfig] = TypeAdapter(ModelConfig)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A validated model definition: its id, folder and config."""

    model_id: str
    folder: Path
    config: AnyModelConfig

    @property
    def backend(self) -> str:
        return self.config.backend

    @property
    def category(self) -> Literal["llm", "vision", "diffusion", "other"]:
        """The config's `category`, else the backend's (`CATEGORY_BY_BACKEND`), else "other"."""
        return self.config.category or CATEGORY_BY_BACKEND.get(self.backend, "other")

    def path(self, relative: str) -> Path:
        """A file named in the config, which must stay inside the model's folder."""
        candidate = (self.folder / relative).resolve()
        if not candidate.is_relative_to(self.folder.resolve()):
            raise ModelConfigError(f"model '{self.model_id}': {relative!r} points outside its folder")
        return candidate


def _format_validation(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"]) or "config"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


def parse_config(model_id: str, folder: Path, data: Any) -> ModelSpec:
    if not isinstance(data, dict):
        raise ModelConfigError(f"model '{model_id}': {CONFIG_FILE} must be a mapping")
    try:
        config = _CONFIG_ADAPTER.validate_python(data)
    except ValidationError as error:
        raise ModelConfigError(f"model '{model_id}': {CONFIG_FILE}: {_format_validation(error)}") from None
    return ModelSpec(model_id=model_id, folder=folder, config=config)


class ModelRepository:
    """Reads model definitions from a folder. File reads only; no engine is touched here."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def names(self) -> list[str]:
        """Model ids: sub-folders that hold a `config.yaml`."""
        if not self.root.is_dir():
            return []
        return sorted(
            entry.name
            for entry in self.root.iterdir()
            if entry.is_dir() and _MODEL_ID.match(entry.name) and (entry / CONFIG_FILE).is_file()
        )

    def contains(self, model_id: str) -> bool:
        return bool(_MODEL_ID.match(model_id)) and (self.root / model_id / CONFIG_FILE).is_file()

    def spec(self, model_id: str) -> ModelSpec:
        """The validated definition; `NotFoundError` for an unknown id, `ModelConfigError` when broken."""
        if not self.contains(model_id):
            raise NotFoundError(f"model '{model_id}' is not in the repository at {self.root}")
        folder = self.root / model_id
        try:
            data = yaml.safe_load((folder / CONFIG_FILE).read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
            raise ModelConfigError(f"model '{model_id}': cannot read {CONFIG_FILE}: {error}") from None
        return parse_config(model_id, folder, data)


def _shape_matches(expected: Sequence[int], actual: Sequence[int]) -> bool:
    # A list comprehension, not all(<genexpr>): this runs for every request, and costs half as much.
    return len(expected) == len(actual) and not [
        e for e, a in zip(expected, actual, strict=True) if e != a and e != -1
    ]


def check_inputs(spec: ModelSpec, arrays: Mapping[str, np.ndarray]) -> None:
    """Raise `InvalidArgumentError` naming the tensor when `arrays` do not fit the declared inputs."""
    declared = spec.config.inputs
    if not declared or not spec.config.enforce_inputs:
        return
    for tensor in declared:
        array = arrays.get(tensor.name)
        if array is None:
            raise InvalidArgumentError(f"model '{spec.model_id}' needs input tensor '{tensor.name}'")
        if array.dtype != tensor.numpy_dtype:
            raise InvalidArgumentError(
                f"tensor '{tensor.name}': dtype {array.dtype.name}, model '{spec.model_id}' "
                f"expects {tensor.dtype}"
            )
        if tensor.shape is not None and not _shape_matches(tensor.shape, array.shape):
            raise InvalidArgumentError(
                f"tensor '{tensor.name}': shape {list(array.shape)}, model '{spec.model_id}' "
                f"expects {list(tensor.shape)} (-1 = any)"
            )
    # Every declared input was found, so equal counts mean no extra ones (the common case).
    if len(arrays) != len(declared) and not spec.config.allow_extra_inputs:
        names = {tensor.name for tensor in declared}
        extra = sorted(key for key in arrays if key not in names)
        if extra:
            raise InvalidArgumentError(
                f"tensor '{extra[0]}' is not an input of model '{spec.model_id}' "
                f"(inputs: {', '.join(sorted(names))})"
            )


def zeros_for(specs: Sequence[TensorSpec]) -> dict[str, np.ndarray] | None:
    """A zero input for warm-up (variable axes of size 1), or None when a shape is unknown."""
    if not specs or any(spec.shape is None for spec in specs):
        return None
    out: dict[str, np.ndarray] = {}
    for spec in specs:
        assert spec.shape is not None
        shape = tuple(1 if dim == -1 else dim for dim in spec.shape)
        if math.prod(shape) > (64 << 20):
            return None
        if spec.dtype == "bytes":
            out[spec.name] = np.full(shape, b"", dtype=object)  # empty byte strings
        else:
            out[spec.name] = np.zeros(shape, dtype=spec.numpy_dtype)
    return out
