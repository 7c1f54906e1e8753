"""Transformers engine: a Hugging Face causal LM served with transformers' continuous batching.

`backend: transformers` in a model's config.yaml; `path` names the HF folder (config.json,
*.safetensors, tokenizer files, chat_template.jinja). It loads with `local_files_only`, so
it never downloads, onto `cpu` or `cuda:N`, and runs transformers' own
`ContinuousBatchingManager` (paged KV cache, FIFO scheduler) on the manager's background
thread. Nothing here decodes on the event loop: tokenising a prompt runs in a thread, the
model runs on the manager's thread, and the loop only turns new token ids into text.

    await engine.submit(request)  -> GenerationStream   (validates first: bad input raises
                                                          InvalidArgumentError, no stream)
    async for event in stream     -> TokenChunk ..., then exactly one GenerationEnd
    engine.cancel(request_id)     -> frees the sequence at the manager's next step and ends
                                     the stream with finish_reason CANCELLED

What the engine adds to the manager (docs/generative.md has the reasons):
- stop strings (the manager only knows eos): matched across chunks on the text, the
  sequence is then cancelled in the manager;
- a terminal event on cancel (the manager delivers none);
- per-request temperature / top_p and greedy decoding (exactly `argmax`), and per-request
  seeds independent of batch mates: two logits processors of ours (`_seeded_sampling.py`);
- structured output (`response_format` JSON / JSON Schema): a grammar mask of ours, first
  in the same processor list (`grammar.py`, docs/structured-output.md);
- log probabilities of the drawn tokens, from the distribution the sampler drew from: two
  more processors of ours around the sampling ones (`_logprobs.py`);
- tools: rendered by the chat template (a template that ignores them is a 400 naming
  `tools`), forced calls constrained by the same mask (`tool_grammar.py`), and calls read
  out of the reply in the model's `tool_format` (`tool_calls.py`, docs/tool-calling.md);
- the order of generations: our scheduler inside the manager (`_cb_scheduler.py`) runs the
  most urgent first, is fair between tenants, and pauses lower-priority sequences (keeping
  their KV cache) for urgent ones (docs/generation-scheduling.md). So the worker hands every
  generation to the engine at once (`orders_generations`): one queue in front of the model.

The pool's lifecycle applies unchanged: `estimate_mb` sizes the lease from the weights plus
the KV budget (num_blocks x block_size x per-token KV bytes) when the config has no
`vram_mb`; load/warmup/unload run on the instance's executor; `infer` (tensors) is refused.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import secrets
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from loadmaster.common.errors import InvalidArgumentError, UnavailableError
from loadmaster.model_pool.engines import (
    _cb_scheduler,
    _chat_templates,
    _logprobs,
    _seeded_sampling,
    grammar,
    tool_grammar,
)
from loadmaster.model_pool.engines._hf_folder import hf_folder, safetensors_files
from loadmaster.model_pool.engines._prefix_cache import PrefixCacheMonitor
from loadmaster.model_pool.engines._token_streams import ChoiceGroup, GenerationStream, StreamState
from loadmaster.model_pool.engines.base import Engine, EngineContext
from loadmaster.model_pool.generation import (
    GenerationRequest,
    GenerationStats,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
)
from loadmaster.model_pool.repository import ModelConfigError, ModelSpec, TransformersModelConfig
from loadmaster.model_pool.tool_calls import ToolCallStream, ToolFormat, chat_dicts, tool_dicts

__all__ = ["TransformersEngine", "kv_bytes_per_token"]

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_MAX_DEFAULT_BLOCKS = 4096
_WARMUP_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 30.0


def _config(spec: ModelSpec) -> TransformersModelConfig:
    assert isinstance(spec.config, TransformersModelConfig)
    return spec.config


def _folder(spec: ModelSpec) -> Path:
    return hf_folder(spec, _config(spec).path)


def _hf_config(spec: ModelSpec) -> dict[str, Any]:
    path = _folder(spec) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ModelConfigError(f"model '{spec.model_id}': cannot read {path}: {error}") from None
    text = data.get("text_config")
    return {**data, **text} if isinstance(text, dict) else dict(data)


def kv_bytes_per_token(hf: Mapping[str, Any], dtype: str) -> int:
    """K and V for one token over all layers: 2 x layers x kv_heads x head_dim x dtype bytes."""
    heads = int(hf.get("num_attention_heads") or 1)
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or int(hf.get("hidden_size", 0)) // heads)
    if dtype == "auto":
        dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
    return 2 * int(hf.get("num_hidden_layers", 1)) * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 4)


def _context_tokens(spec: ModelSpec, hf: Mapping[str, Any]) -> int:
    config = _config(spec)
    model_limit = int(hf.get("max_position_embeddings") or 2048)
    return min(config.max_context_tokens or model_limit, model_limit)


def _num_blocks(spec: ModelSpec, hf: Mapping[str, Any]) -> int:
    config = _config(spec)
    if config.num_blocks is not None:
        return config.num_blocks
    per_sequence = math.ceil(_context_tokens(spec, hf) / config.block_size)
    return min(_MAX_DEFAULT_BLOCKS, max(1, config.resident_sequences * per_sequence))


def _choices(state: StreamState) -> list[StreamState]:
    """A request's sequences: its one, or each of its n choices."""
    return state.group.states if state.group is not None else [state]


class _AnyBroken:
    """The grammar check of n choices (grammar.CheckedStream reads `broken`)."""

    def __init__(self, constraints: list[grammar.Constraint | None]) -> None:
        self._constraints = [c for c in constraints if c is not None]

    @property
    def broken(self) -> str:
        return next((c.broken for c in self._constraints if c.broken), "")


class TransformersEngine(Engine):
    backend = "transformers"
    estimate_factor = 1.2  # weights x this, plus the KV budget
    orders_generations = True  # its scheduler orders and preempts: the worker queues nothing

    def __init__(self, spec: ModelSpec, context: EngineContext) -> None:
        super().__init__(spec, context)
        self._device = torch.device(context.device)
        self._model: Any = None
        self._tokenizer: Any = None
        self._manager: Any = None
        self._prefix = PrefixCacheMonitor()
        self._streams: dict[str, StreamState] = {}
        self._submitted = 0
        self._infos: dict[str, _cb_scheduler.SequenceInfo] = {}  # internal id -> priority, tenant
        self._scheduler_type = ""
        self._vocab_size = 0
        self._eos_ids: frozenset[int] = frozenset()
        self._context_tokens = 0
        self._cache_tokens = 0
        self._grammars: grammar.JsonGrammars | None = None
        self._grammar_mask = grammar.GrammarMask(0)
        self._logprobs = _logprobs.LogprobRecorder()
        self._token_bytes: dict[int, bytes] = {}

    # ---- memory ---------------------------------------------------------

    @classmethod
    def artifact_files(cls, spec: ModelSpec) -> Iterable[Path]:
        return safetensors_files(spec, _folder(spec))

    @classmethod
    def estimate_mb(cls, spec: ModelSpec) -> int:
        """Weights x `estimate_factor` plus the KV cache: num_blocks x block_size x KV bytes/token."""
        weights_mb = super().estimate_mb(spec)
        hf = _hf_config(spec)
        config = _config(spec)
        kv = _num_blocks(spec, hf) * config.block_size * kv_bytes_per_token(hf, config.dtype)
        return weights_mb + math.ceil(kv / (1 << 20))

    # ---- lifecycle (on the instance's executor thread) -------------------

    def load(self) -> None:
        config = _config(self.spec)
        folder = _folder(self.spec)
        hf = _hf_config(self.spec)
        if self.context.threads and torch.get_num_threads() != self.context.threads:
            torch.set_num_threads(self.context.threads)
        if self._device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"device {self._device} requested but CUDA is not available")
            torch.cuda.set_device(self._device)
        self._tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        if (template := _chat_templates.chat_template(self.spec)) is not None:
            self._tokenizer.chat_template = template  # the config's, for a folder without one
        model: Any = AutoModelForCausalLM.from_pretrained(
            folder, local_files_only=True, dtype=config.dtype, attn_implementation=config.attn_implementation
        )
        self._model = model.to(self._device).eval()
        self._vocab_size = int(self._model.config.get_text_config().vocab_size)
        eos = self._model.generation_config.eos_token_id
        if eos is None:
            eos = self._tokenizer.eos_token_id
        self._eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        num_blocks = _num_blocks(self.spec, hf)
        self._context_tokens = _context_tokens(self.spec, hf)
        self._cache_tokens = num_blocks * config.block_size
        # No warpers of the manager's own: ours (`_seeded_sampling`) read every request's values
        # and leave one finite score per row, so the manager's own pick is an argmax
        # (do_sample=False; a softmax and a multinomial over one token would choose the same).
        generation = GenerationConfig(
            do_sample=False,
            top_k=None,
            eos_token_id=sorted(self._eos_ids) or -1,
            pad_token_id=self._tokenizer.pad_token_id,
            max_new_tokens=16,
        )
        self._scheduler_type = _cb_scheduler.install(
            self.context.order_policy, self._infos, resident=config.resident_sequences
        )
        batching = ContinuousBatchingConfig(
            page_size=config.block_size,
            num_blocks=num_blocks,
            max_batch_tokens=config.max_batch_tokens,
            max_requests_per_batch=config.max_sequences,
            per_request_processors=True,
            seed=config.seed,
            scheduler_type=self._scheduler_type,
            auto_switch_to_flash=False,
            allow_block_sharing=config.prefix_caching,  # prefix reuse: _prefix_cache.py
        )
        manager = self._model.init_continuous_batching(
            generation_config=generation, continuous_batching_config=batching
        )
        _seeded_sampling.install(manager.logit_processor)
        self._prefix = PrefixCacheMonitor(max_cached_blocks=config.prefix_cache_max_blocks)
        self._prefix.attach(manager)
        self._grammars = grammar.JsonGrammars(
            self._tokenizer,
            vocab_size=self._vocab_size,
            eos_ids=self._eos_ids,
            refused=grammar.refusal(manager.continuous_batching_config),
        )
        self._grammar_mask = grammar.GrammarMask(self._vocab_size)
        grammar.install(manager.logit_processor, self._grammar_mask)
        self._logprobs = _logprobs.LogprobRecorder()
        _logprobs.install(manager.logit_processor, self._logprobs)
        manager.start()
        self._manager = manager

    def warmup(self) -> None:
        """One short greedy generation, so the first request does not pay for the cache."""
        if not self.spec.config.warmup:
            return
        manager = self._running_manager()
        request_id = manager.add_request(
            [int(self._tokenizer.bos_token_id or 0)],
            request_id="loadmaster-warmup",
            max_new_tokens=2,
            **self._sampling_kwargs(SamplingParams(max_tokens=2, temperature=0.0)),
        )
        result = manager.get_result(request_id=request_id, timeout=_WARMUP_TIMEOUT_S)
        if result is None or result.error:
            raise RuntimeError(f"model '{self.spec.model_id}': warm-up generation failed: {result}")

    def unload(self) -> None:
        manager, self._manager = self._manager, None
        for state in list(self._streams.values()):
            state.fail_threadsafe("the model was unloaded")
        self._streams.clear()
        if manager is not None:
            manager.stop(block=True, timeout=_STOP_TIMEOUT_S, hard_stop=True)  # fail the rest now
        _cb_scheduler.uninstall(self._scheduler_type)
        self._infos.clear()
        self._model = None
        self._tokenizer = None
        gc.collect()
        if self._device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(self._device)
            torch.cuda.empty_cache()

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise InvalidArgumentError(
            f"model '{self.spec.model_id}' is generative (backend transformers): send it a generation "
            "request, not tensors"
        )

    # ---- generation (on the event loop) ---------------------------------

    @property
    def healthy(self) -> bool:
        """False once loaded and the manager's batching thread has stopped (it died)."""
        manager = self._manager
        return manager is None or manager.is_running()

    @property
    def context_tokens(self) -> int:
        """The longest sequence (prompt + max_tokens) a request may ask for."""
        return min(self._context_tokens, self._cache_tokens)

    async def submit(self, request: GenerationRequest) -> GenerationStream:
        """Validate, tokenise (in a thread) and queue one generation; its events follow on the stream.

        With `n` > 1 the prompt is submitted once with n - 1 children: transformers' manager
        prefills it, then forks the sequence (the children share its KV pages) and each
        choice draws with its own seed (`_seeded_sampling.choice_seed`)."""
        request.check()
        self._running_manager()
        self._check_new_id(request.request_id)
        if request.n > _config(self.spec).max_sequences:
            raise InvalidArgumentError(
                f"n: {request.n} choices is more than model '{self.spec.model_id}' runs at once "
                f"({_config(self.spec).max_sequences})"
            )
        prompt = await asyncio.to_thread(self._prompt_ids, request)
        constraints = [await self._constraint(request) for _ in range(request.n)]
        if request.logprobs is not None and self._grammars is not None:
            await asyncio.to_thread(self._grammars.tokenizer)  # token bytes: built once, off the loop
        manager = self._running_manager()  # again: the model may have unloaded meanwhile
        self._check_new_id(request.request_id)  # and the same id may have arrived meanwhile
        limit = self.context_tokens
        if len(prompt) + request.params.max_tokens > limit:
            raise InvalidArgumentError(
                f"prompt of {len(prompt)} tokens + max_tokens {request.params.max_tokens} exceeds the "
                f"context of model '{self.spec.model_id}' ({limit} tokens)"
            )
        self._submitted += 1
        internal_id = f"{request.request_id}#{self._submitted}"
        kwargs = self._sampling_kwargs(request.params, logprobs=request.logprobs)
        group = ChoiceGroup(request.request_id, len(prompt)) if request.n > 1 else None
        states = []
        for choice in range(request.n):
            state = StreamState(
                request_id=request.request_id,
                internal_id=internal_id
                if choice == 0
                else f"{internal_id}{_seeded_sampling.CHILD_MARK}{choice - 1}",
                prompt_tokens=len(prompt),
                params=request.params,
                tokenizer=self._tokenizer,
                eos_ids=self._eos_ids,
                on_done=self._forget,
                cancel_in_manager=manager.cancel_request,
                loop=asyncio.get_running_loop(),
                prompt_ids=tuple(prompt),
                sampling_kwargs=_seeded_sampling.for_choice(kwargs, choice),
                logprob_of=self._logprob_of if request.logprobs is not None else None,
            )
            if group is not None:
                group.join(state)
            states.append(state)
        self._streams[request.request_id] = states[0]
        # its place in the engine's queue (its forks are found by the parent's id)
        self._infos[internal_id] = _cb_scheduler.SequenceInfo(
            request.priority, request.tenant, request.tenant_weight
        )
        for state, constraint in zip(states, constraints, strict=True):
            if constraint is not None:
                self._grammar_mask.attach(state.internal_id, constraint)
            manager.register_result_handler(state.internal_id, state.on_output)
        try:
            manager.num_return_sequences = request.n  # read by add_request only, on this thread
            try:
                accepted = manager.add_request(
                    prompt,
                    request_id=internal_id,
                    max_new_tokens=request.params.max_tokens,
                    streaming=True,
                    **kwargs,
                )
            finally:
                manager.num_return_sequences = 1
        except Exception:
            for state in states:
                self._forget(state)
            self._infos.pop(internal_id, None)
            raise
        if accepted is None:  # the manager is stopping: it drops the request with a log line
            for state in states:
                self._forget(state)
            raise UnavailableError(f"model '{self.spec.model_id}' is stopping; try another worker")
        stream = GenerationStream(group or states[0], self.cancel)
        checked: GenerationStream = stream
        if constraints[0] is not None:
            checked = grammar.CheckedStream(stream, _AnyBroken(constraints))  # type: ignore[arg-type]
        if request.tools is None or not request.tool_calls_parsed:
            return checked
        return ToolCallStream(  # type: ignore[return-value]
            checked,
            format=ToolFormat(_config(self.spec).tool_format),
            names=[f.name for f in request.tools.functions],
            parallel=request.tools.parallel,
        )

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Any]:
        """`submit` then iterate: events until the terminal one."""
        stream = await self.submit(request)
        async for event in stream:
            yield event

    def cancel(self, request_id: str) -> bool:
        """Cancel a generation; False when it is not running here (finished or unknown)."""
        state = self._streams.get(request_id)
        if state is None:
            return False
        (state.group or state).cancel()
        return True

    def queue_position(self, request_id: str) -> int | None:
        """How many generations are ahead of a waiting one in the engine's queue (None:
        running, finished or unknown)."""
        state = self._streams.get(request_id)
        scheduler = self._scheduler()
        if state is None or scheduler is None:
            return None
        return scheduler.positions.get(state.internal_id)

    def scheduling(self) -> _cb_scheduler.SchedulerSnapshot:
        """The scheduler's counts (preemptions, yields, KV kept/recomputed) and tenants."""
        scheduler = self._scheduler()
        return scheduler.snapshot if scheduler is not None else _cb_scheduler.SchedulerSnapshot()

    def set_remote_service(self, service: dict[str, float]) -> None:
        """What each tenant got from this model on other workers (the scheduler's exchange):
        its counters add it from the next step on."""
        scheduler = self._scheduler()
        if scheduler is not None:
            scheduler.remote_service = dict(service)

    def tenant_service(self) -> dict[str, float]:
        """The weighted service this engine gave each tenant since it loaded."""
        return dict(self.scheduling().service)

    def _scheduler(self) -> _cb_scheduler.PriorityScheduler | None:
        processor = getattr(self._manager, "batch_processor", None)
        scheduler = getattr(processor, "scheduler", None)
        return scheduler if isinstance(scheduler, _cb_scheduler.PriorityScheduler) else None

    def stats(self) -> GenerationStats:
        """Sequences and KV blocks right now (read without a lock: a snapshot for metrics)."""
        manager = self._manager
        processor = getattr(manager, "batch_processor", None)
        if processor is None:
            return GenerationStats(0, 0, 0, self._cache_tokens // max(1, _config(self.spec).block_size))
        scheduler = processor.scheduler
        cache = processor.cache
        total = int(getattr(cache, "num_blocks", 0))
        free_fraction = float(cache.compute_free_capacity(relative=True))
        prefix = self._prefix.stats()
        return GenerationStats(
            running=len(scheduler.active_requests),
            waiting=len(scheduler.waiting_requests) + manager.input_queue.qsize(),
            kv_blocks_used=max(0, round((1.0 - free_fraction) * total)),
            kv_blocks_total=total,
            streams_open=len(self._streams),
            preemptions=self.scheduling().preemptions,
            prefix_lookups=prefix.lookups,
            prefix_hits=prefix.hits,
            prefix_tokens_reused=prefix.tokens_reused,
            prefix_blocks_evicted=prefix.blocks_evicted,
            prefix_blocks_cached=prefix.blocks_cached,
        )

    # ---- helpers --------------------------------------------------------

    def _running_manager(self) -> Any:
        manager = self._manager
        if manager is None or not manager.is_running():
            raise UnavailableError(
                f"model '{self.spec.model_id}' is not loaded (or its batching thread died)"
            )
        return manager

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self._streams:
            raise InvalidArgumentError(f"request_id: {request_id!r} is already generating")

    def _forget(self, state: StreamState) -> None:
        key = state.request_id
        primary = self._streams.get(key)
        if primary is not None and primary in _choices(state) and all(c.done for c in _choices(state)):
            del self._streams[key]
        self._grammar_mask.detach(state.internal_id)
        self._logprobs.forget(state.internal_id)
        self._drop_handler(state.internal_id)

    def _drop_handler(self, internal_id: str) -> None:
        manager = self._manager
        if manager is not None:  # the manager drops its handler only on a finished output
            with manager.output_router._lock:
                manager.output_router.result_handlers.pop(internal_id, None)

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        tokenizer = self._tokenizer
        if request.prompt_token_ids is not None:
            ids = [int(token) for token in request.prompt_token_ids]
            for index, token in enumerate(ids):
                if not 0 <= token < self._vocab_size:
                    raise InvalidArgumentError(
                        f"prompt_token_ids[{index}]: {token} is outside the vocabulary (0..{self._vocab_size - 1})"
                    )
            return ids
        if request.messages is not None:
            if not getattr(tokenizer, "chat_template", None):
                raise InvalidArgumentError(
                    f"model '{self.spec.model_id}' has no chat template: send a prompt"
                )
            messages = chat_dicts(request.messages)
            template_kwargs = _chat_templates.template_kwargs(_config(self.spec), request)
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **template_kwargs
            )
            if request.tools is not None:
                with_tools = tokenizer.apply_chat_template(
                    messages,
                    tools=tool_dicts(request.tools),
                    add_generation_prompt=True,
                    tokenize=False,
                    **template_kwargs,
                )
                if with_tools == text:
                    raise InvalidArgumentError(
                        f"tools: the chat template of model '{self.spec.model_id}' does not render tools "
                        "(it has no tool support)"
                    )
                text = with_tools
            return list(tokenizer.encode(text, add_special_tokens=False))
        assert request.prompt is not None
        return list(tokenizer.encode(request.prompt, add_special_tokens=True))

    async def _constraint(self, request: GenerationRequest) -> grammar.Constraint | None:
        """The grammar state of a structured-output request (with its token budget: a
        `max_tokens` no valid reply fits in is refused here) or of forced tool calls, compiled
        and planned in a thread."""
        forced = request.tools is not None and request.tools.constrained
        if request.response_format is None and not forced:
            return None
        grammars = self._grammars
        if grammars is None:
            raise UnavailableError(f"model '{self.spec.model_id}' is not loaded")
        if forced:
            assert request.tools is not None
            manager = self._running_manager()
            return await asyncio.to_thread(
                tool_grammar.tool_constraint,
                grammars,
                request.tools,
                ToolFormat(_config(self.spec).tool_format),
                eos_ids=self._eos_ids,
                refused=grammar.refusal(manager.continuous_batching_config),
            )
        assert request.response_format is not None
        return await asyncio.to_thread(
            grammars.constraint, request.response_format, max_tokens=request.params.max_tokens
        )

    def _sampling_kwargs(self, params: SamplingParams, *, logprobs: int | None = None) -> dict[str, Any]:
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        kwargs = {
            _seeded_sampling.WARP_KWARG: _seeded_sampling.pack_warp(params.temperature, params.top_p),
            _seeded_sampling.SEED_KWARG: int(seed),
        }
        if logprobs is not None:
            kwargs[_logprobs.LOGPROBS_KWARG] = logprobs + 1
        return kwargs

    def _logprob_of(self, internal_id: str, position: int, token: int) -> TokenLogprob:
        """A drawn token's log probability (recorded on the manager's thread), with its bytes."""
        record = self._logprobs.take(internal_id, position)
        if record is None or record.token != token:  # not expected: said, not made up
            return TokenLogprob(token, self._bytes(token), float("nan"))
        top = tuple(TopLogprob(t, self._bytes(t), value) for t, value in record.top)
        return TokenLogprob(token, self._bytes(token), record.logprob, top)

    def _bytes(self, token: int) -> bytes:
        cached = self._token_bytes.get(token)
        if cached is None:
            grammars = self._grammars
            cached = bytes(grammars.tokenizer().decode_bytes([token])) if grammars is not None else b""
            self._token_bytes[token] = cached
        return cached
