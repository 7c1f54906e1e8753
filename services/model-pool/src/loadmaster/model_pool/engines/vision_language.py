"""Vision-language engine: a Hugging Face image-text-to-text model, one token at a time.

`backend: transformers_vlm` in a model's config.yaml; `path` names the HF folder (config.json
with a vision tower, safetensors, the processor's files and a chat template). It loads with
`local_files_only` (`AutoProcessor`, `AutoModelForImageTextToText`), so it never downloads.

transformers' continuous-batching manager serves text-only causal LMs: it has no place for
pixel values. So this engine is simpler than `engines/transformers.py` (docs/dialects.md):

- its own thread runs every open sequence in turn, one decode step each (prefill with the
  images first), each with its own KV cache (transformers' `DynamicCache`): sequences are interleaved, not
  batched, so a step costs one forward pass per running sequence;
- the worker's queue in front of it works unchanged: at most `max_sequences` run, the most
  urgent first, and a priority-0 stream may preempt one (`preempt` pauses a sequence and
  keeps its cache; `resume` carries on from the next token, so nothing is recomputed);
- per-request temperature / top_p / seed (a generator per sequence: a seeded reply does not
  depend on its neighbours), stop strings, max_tokens, cancel; no structured output, tools,
  log probabilities or n > 1 (each a 400 naming the field), no prefix cache, no paged KV budget.

Images are decoded and checked (`max_image_pixels`, `max_images`) on a thread when the
request is submitted, never on the event loop; the processor resizes them as the model wants.
"""

from __future__ import annotations

import asyncio
import gc
import io
import secrets
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

from loadmaster.common.errors import InvalidArgumentError, UnavailableError
from loadmaster.model_pool.engines._hf_folder import hf_folder, safetensors_files
from loadmaster.model_pool.engines._token_streams import GenerationStream, StreamState
from loadmaster.model_pool.engines.base import Engine, EngineContext
from loadmaster.model_pool.generation import GenerationRequest, GenerationStats, SamplingParams
from loadmaster.model_pool.repository import ModelSpec, VisionLanguageModelConfig

__all__ = ["VisionLanguageEngine", "sample_token"]

_STOP_TIMEOUT_S = 30.0


def _config(spec: ModelSpec) -> VisionLanguageModelConfig:
    assert isinstance(spec.config, VisionLanguageModelConfig)
    return spec.config


def _folder(spec: ModelSpec) -> Path:
    return hf_folder(spec, _config(spec).path)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The next token from one position's logits: argmax at temperature 0, else a draw from
    the tempered distribution cut to its top-p nucleus."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p  # the first always
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass(slots=True)
class _Output:
    """One step's result, in the shape `StreamState.on_output` reads (the manager's)."""

    request_id: str
    generated_tokens: list[int]
    finished: bool
    error: str | None = None

    def is_finished(self) -> bool:
        return self.finished


@dataclass(slots=True, eq=False)
class _Sequence:
    state: StreamState
    inputs: dict[str, Any] | None  # the prefill's tensors (dropped once it ran)
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    cache: Any = None
    paused: bool = False
    cancelled: bool = False


class VisionLanguageEngine(Engine):
    backend = "transformers_vlm"
    estimate_factor = 1.5  # weights, activations of a prefill with images, a few small KV caches
    takes_images = True

    def __init__(self, spec: ModelSpec, context: EngineContext) -> None:
        super().__init__(spec, context)
        self._device = torch.device(context.device)
        self._model: Any = None
        self._processor: Any = None
        self._tokenizer: Any = None
        self._eos_ids: frozenset[int] = frozenset()
        self._context_tokens = 0
        self._streams: dict[str, StreamState] = {}  # request id -> state (on the loop)
        self._sequences: dict[str, _Sequence] = {}  # internal id -> sequence (under _wake)
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._submitted = 0
        self._preemptions = 0

    # ---- memory ---------------------------------------------------------

    @classmethod
    def artifact_files(cls, spec: ModelSpec) -> Iterable[Path]:
        return safetensors_files(spec, _folder(spec))

    # ---- lifecycle (on the instance's executor thread) -------------------

    def load(self) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        config = _config(self.spec)
        folder = _folder(self.spec)
        if self.context.threads and torch.get_num_threads() != self.context.threads:
            torch.set_num_threads(self.context.threads)
        if self._device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"device {self._device} requested but CUDA is not available")
            torch.cuda.set_device(self._device)
        self._processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
        self._tokenizer = self._processor.tokenizer
        model: Any = AutoModelForImageTextToText.from_pretrained(
            folder, local_files_only=True, dtype=config.dtype
        )
        self._model = model.to(self._device).eval()
        text = self._model.config.get_text_config()
        eos = self._model.generation_config.eos_token_id
        if eos is None:
            eos = self._tokenizer.eos_token_id
        self._eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        limit = int(getattr(text, "max_position_embeddings", 0) or 2048)
        self._context_tokens = min(config.max_context_tokens or limit, limit)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"vlm-{self.spec.model_id}", daemon=True)
        self._thread.start()

    def warmup(self) -> None:
        """One greedy step on a short text prompt, so the first request does not pay for it."""
        if not self.spec.config.warmup:
            return
        ids = self._tokenizer("hi", return_tensors="pt")
        with torch.inference_mode():
            self._model(**{k: v.to(self._device) for k, v in ids.items()}, use_cache=True)

    def unload(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=_STOP_TIMEOUT_S)
            self._thread = None
        for state in list(self._streams.values()):
            state.fail_threadsafe("the model was unloaded")
        self._streams.clear()
        with self._wake:
            self._sequences.clear()
        self._model = self._processor = self._tokenizer = None
        gc.collect()
        if self._device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(self._device)
            torch.cuda.empty_cache()

    def infer(self, inputs: Any) -> dict[str, Any]:
        raise InvalidArgumentError(
            f"model '{self.spec.model_id}' is generative (backend transformers_vlm): send it a chat, not tensors"
        )

    # ---- generation (on the event loop) ---------------------------------

    @property
    def healthy(self) -> bool:
        """False once loaded and the decoding thread has stopped (it died)."""
        return self._model is None or (self._thread is not None and self._thread.is_alive())

    @property
    def context_tokens(self) -> int:
        return self._context_tokens

    async def submit(self, request: GenerationRequest) -> GenerationStream:
        """Validate, decode the images and build the prompt (in a thread), and queue one sequence."""
        request.check()
        config = _config(self.spec)
        for name, asked in (
            ("response_format", request.response_format is not None),
            ("tools", request.tools is not None),
            ("logprobs", request.logprobs is not None),
            ("n", request.n > 1),
        ):
            if asked:
                raise InvalidArgumentError(
                    f"{name}: model '{self.spec.model_id}' (backend transformers_vlm) does not support it"
                )
        if request.images > config.max_images:
            raise InvalidArgumentError(
                f"messages: {request.images} images, model '{self.spec.model_id}' takes at most {config.max_images}"
            )
        self._running()
        if request.request_id in self._streams:
            raise InvalidArgumentError(f"request_id: {request.request_id!r} is already generating")
        inputs = await asyncio.to_thread(self._inputs, request)
        self._running()  # again: the model may have unloaded meanwhile
        prompt_ids = inputs["input_ids"][0].tolist()
        if len(prompt_ids) + request.params.max_tokens > self._context_tokens:
            raise InvalidArgumentError(
                f"prompt of {len(prompt_ids)} tokens + max_tokens {request.params.max_tokens} exceeds the "
                f"context of model '{self.spec.model_id}' ({self._context_tokens} tokens)"
            )
        if request.request_id in self._streams:
            raise InvalidArgumentError(f"request_id: {request.request_id!r} is already generating")
        self._submitted += 1
        internal_id = f"{request.request_id}#{self._submitted}"
        state = StreamState(
            request_id=request.request_id,
            internal_id=internal_id,
            prompt_tokens=len(prompt_ids),
            params=request.params,
            tokenizer=self._tokenizer,
            eos_ids=self._eos_ids,
            on_done=self._forget,
            cancel_in_manager=self._drop,
            loop=asyncio.get_running_loop(),
            prompt_ids=tuple(prompt_ids),
        )
        seed = request.params.seed if request.params.seed is not None else secrets.randbits(63)
        generator = torch.Generator().manual_seed(int(seed) & ((1 << 63) - 1))
        sequence = _Sequence(state, {k: v.to(self._device) for k, v in inputs.items()}, generator)
        self._streams[request.request_id] = state
        with self._wake:
            self._sequences[internal_id] = sequence
            self._wake.notify_all()
        return GenerationStream(state, self.cancel)

    def cancel(self, request_id: str) -> bool:
        state = self._streams.get(request_id)
        if state is None:
            return False
        state.cancel()
        return True

    def preempt(self, request_id: str) -> bool:
        """Pause a running sequence (its KV cache is kept); `resume` goes on from the next token."""
        sequence = self._sequence_of(request_id)
        if sequence is None or sequence.paused:
            return False
        sequence.paused = True
        self._preemptions += 1
        return True

    def resume(self, request_id: str) -> bool:
        sequence = self._sequence_of(request_id)
        if sequence is None or not sequence.paused:
            return False
        with self._wake:
            sequence.paused = False
            self._wake.notify_all()
        return True

    def stats(self) -> GenerationStats:
        with self._wake:
            sequences = list(self._sequences.values())
        paused = sum(1 for s in sequences if s.paused)
        return GenerationStats(
            running=len(sequences) - paused,
            waiting=paused,
            kv_blocks_used=0,
            kv_blocks_total=0,
            preemptions=self._preemptions,
            streams_open=len(self._streams),
        )

    # ---- helpers (loop side) ---------------------------------------------

    def _running(self) -> None:
        if self._model is None or not self.healthy:
            raise UnavailableError(
                f"model '{self.spec.model_id}' is not loaded (or its decoding thread died)"
            )

    def _sequence_of(self, request_id: str) -> _Sequence | None:
        state = self._streams.get(request_id)
        if state is None:
            return None
        with self._wake:
            return self._sequences.get(state.internal_id)

    def _drop(self, internal_id: str) -> None:
        """A stream ended on the loop side (cancel, stop string): its sequence goes."""
        with self._wake:
            sequence = self._sequences.pop(internal_id, None)
        if sequence is not None:
            sequence.cancelled = True

    def _forget(self, state: StreamState) -> None:
        key, internal_id = state.request_id, state.internal_id
        if self._streams.get(key) is state:
            del self._streams[key]
        self._drop(internal_id)

    # ---- prompt building (a worker thread) --------------------------------

    def _inputs(self, request: GenerationRequest) -> dict[str, Any]:
        processor = self._processor
        if request.prompt_token_ids is not None:
            vocab = int(self._model.config.get_text_config().vocab_size)
            for index, token in enumerate(request.prompt_token_ids):
                if not 0 <= token < vocab:
                    raise InvalidArgumentError(
                        f"prompt_token_ids[{index}]: {token} is outside the vocabulary"
                    )
            return {"input_ids": torch.tensor([list(request.prompt_token_ids)])}
        if request.prompt is not None:
            return dict(processor(text=request.prompt, return_tensors="pt"))
        assert request.messages is not None
        if not getattr(processor, "chat_template", None):
            raise InvalidArgumentError(f"model '{self.spec.model_id}' has no chat template: send a prompt")
        images: list[Image.Image] = []
        conversation: list[dict[str, Any]] = []
        for index, message in enumerate(request.messages):
            if not message.images:
                conversation.append({"role": message.role, "content": message.content})
                continue
            images.extend(self._image(data, index) for data in message.images)
            parts: list[dict[str, Any]] = [{"type": "image"} for _ in message.images]
            parts.append({"type": "text", "text": message.content})
            conversation.append({"role": message.role, "content": parts})
        text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        return dict(
            processor(text=text, images=images or None, return_tensors="pt", add_special_tokens=False)
        )

    def _image(self, data: bytes, index: int) -> Image.Image:
        limit = _config(self.spec).max_image_pixels
        try:
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > limit:
                raise InvalidArgumentError(
                    f"messages[{index}]: an image of {width}x{height} pixels exceeds the limit of {limit}"
                )
            return image.convert("RGB")
        except InvalidArgumentError:
            raise
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as error:
            raise InvalidArgumentError(f"messages[{index}]: an image could not be decoded: {error}") from None

    # ---- decoding (the engine's thread) -------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not any(not s.paused for s in self._sequences.values()):
                    self._wake.wait()
                if self._stopping:
                    return
                turn = [s for s in self._sequences.values() if not s.paused]
            for sequence in turn:
                if sequence.cancelled or sequence.paused:
                    continue
                try:
                    finished = self._step(sequence)
                except Exception as error:  # this sequence fails; the others go on
                    self._deliver(
                        sequence,
                        _Output(sequence.state.internal_id, [], True, f"{type(error).__name__}: {error}"),
                    )
                    finished = True
                if finished:
                    self._drop(sequence.state.internal_id)

    def _step(self, sequence: _Sequence) -> bool:
        with torch.inference_mode():
            if sequence.cache is None:
                assert sequence.inputs is not None
                out = self._model(**sequence.inputs, use_cache=True)
                sequence.inputs = None
            else:
                last = torch.tensor([[sequence.tokens[-1]]], device=self._device)
                out = self._model(input_ids=last, cache=sequence.cache, use_cache=True)
            sequence.cache = out.cache
            logits = out.logits[0, -1].to("cpu")
        state = sequence.state
        token = sample_token(logits, state.params, sequence.generator)
        sequence.tokens.append(token)
        finished = token in self._eos_ids or len(sequence.tokens) >= state.params.max_tokens
        self._deliver(sequence, _Output(state.internal_id, list(sequence.tokens), finished))
        return finished

    @staticmethod
    def _deliver(sequence: _Sequence, output: _Output) -> None:
        try:
            sequence.state.loop.call_soon_threadsafe(sequence.state.on_output, output)
        except RuntimeError:  # the loop is closed: nobody is listening
            sequence.cancelled = True
