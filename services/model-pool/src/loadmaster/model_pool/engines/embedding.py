"""Embedding engine: a Hugging Face encoder folder that turns texts into vectors.

`backend: embedding` in a model's config.yaml; `path` names the HF folder (config.json,
*.safetensors, tokenizer files). It loads with `local_files_only` onto `cpu` or `cuda:N`.
It is a tensor model like any other: the worker's batcher stacks concurrent requests on dim 0
(up to `max_batch_size` inputs), and one forward pass embeds them all.

Tensors (the gateway's `/v1/embeddings` builds them; any v2 client may too):

    text        BYTES [n]   UTF-8 text, one input per row ("" where the row is token ids)
    token_ids   BYTES [n]   little-endian uint32 token ids ("" where the row is text)
    dimensions  INT32 [n]   the vector size asked per row: 0 = the model's own, else one of
                            the config's `dimensions` (the first N components, re-normalised)
    ->
    embedding   FLOAT32 [n, D]  D = the model's hidden size; a shorter row is zero-padded
    tokens      INT32 [n]       each input's token count (usage)

Pooling is the config's `pooling` (`mean` over the input's tokens, the first token's state
`cls`, or the `last` token's), then unit length with `normalize`. An empty input, a token id
outside the vocabulary, an input longer than `max_input_tokens` (default: the model's
positions) or an unsupported `dimensions` is an `InvalidArgumentError` naming it; the batcher
then runs the batch's requests one by one, so only the request at fault fails.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.model_pool.engines._hf_folder import hf_folder, safetensors_files
from loadmaster.model_pool.engines.base import Engine, EngineContext
from loadmaster.model_pool.repository import EmbeddingModelConfig, ModelConfigError, ModelSpec

__all__ = ["EmbeddingEngine"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _config(spec: ModelSpec) -> EmbeddingModelConfig:
    assert isinstance(spec.config, EmbeddingModelConfig)
    return spec.config


def _folder(spec: ModelSpec) -> Path:
    return hf_folder(spec, _config(spec).path)


def _rows(inputs: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    array = inputs.get(name)
    if array is None:
        raise InvalidArgumentError(f"input '{name}' is required")
    if array.ndim != 1:
        raise InvalidArgumentError(
            f"input '{name}': one dimension (one element per input), got {list(array.shape)}"
        )
    return array


class EmbeddingEngine(Engine):
    backend = "embedding"

    def __init__(self, spec: ModelSpec, context: EngineContext) -> None:
        super().__init__(spec, context)
        self._device = torch.device(context.device)
        self._model: Any = None
        self._tokenizer: Any = None
        self._hidden = 0
        self._vocab = 0
        self._max_tokens = 0
        self._pad = 0

    @classmethod
    def artifact_files(cls, spec: ModelSpec) -> Iterable[Path]:
        return safetensors_files(spec, _folder(spec))

    # ---- lifecycle (on the instance's thread) ---------------------------

    def load(self) -> None:
        from transformers import AutoModel, AutoTokenizer

        config = _config(self.spec)
        folder = _folder(self.spec)
        if self.context.threads and torch.get_num_threads() != self.context.threads:
            torch.set_num_threads(self.context.threads)
        if self._device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"device {self._device} requested but CUDA is not available")
            # This instance's thread runs every call of this engine: what torch allocates
            # without naming a device (its CUDA context, workspaces) goes to the leased GPU,
            # not to GPU 0, as in the torch, transformers and vision engines.
            torch.cuda.set_device(self._device)
        self._tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        dtype = _DTYPES.get(config.dtype, "auto")
        model: Any = AutoModel.from_pretrained(folder, local_files_only=True, dtype=dtype)
        self._model = model.to(self._device).eval()
        text_config = self._model.config.get_text_config()
        self._hidden = int(text_config.hidden_size)
        self._vocab = int(text_config.vocab_size)
        positions = int(getattr(text_config, "max_position_embeddings", 0) or 512)
        self._max_tokens = min(config.max_input_tokens or positions, positions)
        self._pad = int(self._tokenizer.pad_token_id or 0)
        too_big = [size for size in config.dimensions if size > self._hidden]
        if too_big:
            raise ModelConfigError(
                f"model '{self.spec.model_id}': dimensions {too_big} exceed its vectors' size {self._hidden}"
            )

    def warmup(self) -> None:
        if self.spec.config.warmup:
            self.infer(
                {
                    "text": np.array([b"warm up"], dtype=object),
                    "token_ids": np.array([b""], dtype=object),
                    "dimensions": np.zeros(1, dtype=np.int32),
                }
            )

    def unload(self) -> None:
        self._model = None
        self._tokenizer = None
        gc.collect()
        if self._device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(self._device)
            torch.cuda.empty_cache()

    # ---- inference ------------------------------------------------------

    def _sequences(self, inputs: Mapping[str, np.ndarray]) -> list[list[int]]:
        texts = _rows(inputs, "text")
        ids = _rows(inputs, "token_ids")
        if texts.shape != ids.shape:
            raise InvalidArgumentError(
                f"inputs 'text' and 'token_ids': one element each per input, got {texts.shape} and {ids.shape}"
            )
        sequences: list[list[int]] = []
        for row, (text, packed) in enumerate(zip(texts.tolist(), ids.tolist(), strict=True)):
            if packed:
                if len(packed) % 4:
                    raise InvalidArgumentError(f"input[{row}]: token ids are 4-byte little-endian integers")
                tokens = np.frombuffer(packed, dtype="<u4").tolist()
                bad = next((t for t in tokens if t >= self._vocab), None)
                if bad is not None:
                    raise InvalidArgumentError(
                        f"input[{row}]: token id {bad} is outside the vocabulary (0..{self._vocab - 1})"
                    )
            else:
                try:
                    decoded = bytes(text).decode()
                except UnicodeDecodeError:
                    raise InvalidArgumentError(f"input[{row}]: not UTF-8 text") from None
                tokens = list(self._tokenizer.encode(decoded, add_special_tokens=True))
            if not tokens:
                raise InvalidArgumentError(f"input[{row}]: empty (an input needs at least one token)")
            if len(tokens) > self._max_tokens:
                raise InvalidArgumentError(
                    f"input[{row}]: {len(tokens)} tokens, model '{self.spec.model_id}' takes at most {self._max_tokens}"
                )
            sequences.append(tokens)
        return sequences

    def _dimensions(self, inputs: Mapping[str, np.ndarray], rows: int) -> list[int]:
        asked = _rows(inputs, "dimensions")
        if asked.shape != (rows,) or asked.dtype.kind not in "iu":
            raise InvalidArgumentError(
                f"input 'dimensions': INT32 [{rows}], got {asked.dtype.name} {list(asked.shape)}"
            )
        allowed = set(_config(self.spec).dimensions) | {self._hidden}
        out = []
        for row, size in enumerate(asked.tolist()):
            size = size or self._hidden
            if size not in allowed:
                sizes = ", ".join(str(s) for s in sorted(allowed))
                raise InvalidArgumentError(
                    f"dimensions: {size} is not a size model '{self.spec.model_id}' makes (input[{row}]; sizes: {sizes})"
                )
            out.append(size)
        return out

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        model = self._model
        if model is None:
            raise RuntimeError(f"model '{self.spec.model_id}' is not loaded")
        config = _config(self.spec)
        sequences = self._sequences(inputs)
        sizes = self._dimensions(inputs, len(sequences))
        width = max(len(tokens) for tokens in sequences)
        ids = torch.full((len(sequences), width), self._pad, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, tokens in enumerate(sequences):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = 1
        with torch.inference_mode():
            states = model(
                input_ids=ids.to(self._device), attention_mask=mask.to(self._device)
            ).last_hidden_state
            states = states.float()
            weights = mask.to(states.device).unsqueeze(-1).float()
            if config.pooling == "mean":
                pooled = (states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
            elif config.pooling == "cls":
                pooled = states[:, 0]
            else:
                last = mask.sum(dim=1).to(states.device) - 1
                pooled = states[torch.arange(states.size(0), device=states.device), last]
            vectors = pooled.cpu().numpy().astype(np.float32)
        out = np.zeros((len(sequences), self._hidden), dtype=np.float32)
        for row, size in enumerate(sizes):
            vector = vectors[row, :size]
            if config.normalize:
                norm = float(np.linalg.norm(vector))
                vector = vector / norm if norm > 0 else vector
            out[row, :size] = vector
        return {"embedding": out, "tokens": np.array([len(t) for t in sequences], dtype=np.int32)}
