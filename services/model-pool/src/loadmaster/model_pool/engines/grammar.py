"""Structured output for the transformers engine: JSON grammars from llguidance, applied as a
token mask inside transformers' continuous batching.

`response_format` `json_object` or `json_schema` becomes an llguidance grammar (compiled in a
worker thread, never on the event loop; a schema llguidance cannot compile, or a keyword it
does not implement, is an `InvalidArgumentError` naming the problem: a 400 at the gateway).
Each constrained sequence gets a `Constraint` (an `LLMatcher` and how many of its tokens it
has consumed). `GrammarMask` is the first of the manager's per-request logits processors
(transformers 5.24 has no custom per-request processor of its own, but its
`ContinuousBatchingLogitsProcessorList` takes ours, as `_seeded_sampling` does): before each
step it brings every constrained sequence's matcher up to date with the tokens generated
since, fills that row's allowed-token bitmask, and sets every other token of the row to -inf.
The warper and the seeded sampler run after it, so temperature, top_p, greedy and seeds work
unchanged, and a token the grammar forbids can never be drawn. When the value is complete the
grammar allows only end-of-sequence, so the reply ends with finish_reason "stop"; a reply cut
by `max_tokens` first ends with "length" and is then not complete JSON.

Output is compact (no whitespace between tokens of the JSON): a random-weight model cannot
loop on spaces. docs/structured-output.md has why llguidance, what was measured, and the cost.
The CPU (synchronous batching) path only: the mask is computed per step outside the model's
forward, which a captured CUDA graph would not see (the engine leaves CUDA graphs off).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
)

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.model_pool.engines._token_streams import GenerationStream
from loadmaster.model_pool.generation import FinishReason, GenerationEnd, GenerationEvent, ResponseFormat

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["CheckedStream", "Constraint", "GrammarMask", "JsonGrammars", "install", "refusal"]

log = logging.getLogger(__name__)

# Compact JSON: no whitespace between tokens, "," and ":" as separators.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
_JSON_OBJECT: dict[str, Any] = {"type": "object"}  # OpenAI's json_object: any JSON object
_BITS = torch.arange(32, dtype=torch.int32)


class JsonGrammars:
    """Compiles response formats against one model's tokenizer (thread-safe; the tokenizer
    conversion, about a second, happens on the first constrained request)."""

    def __init__(
        self, tokenizer: Any, *, vocab_size: int, eos_ids: Collection[int], refused: str | None = None
    ) -> None:
        self._refused = refused  # why this model's manager cannot take a grammar, if it cannot
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_ids = sorted(eos_ids)
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos_ids or None
                )
            return self._tokenizer

    def grammar(self, response_format: ResponseFormat) -> str:
        """The llguidance grammar of a response format; `InvalidArgumentError` naming the
        problem when the schema is not JSON or llguidance cannot compile it."""
        response_format.check()
        if self._refused:
            raise InvalidArgumentError(f"response_format: not available on this model: {self._refused}")
        where = "response_format.json_schema.schema"
        schema: Any = _JSON_OBJECT
        if response_format.kind == "json_schema":
            try:
                schema = json.loads(response_format.schema)
            except ValueError as error:
                raise InvalidArgumentError(f"{where}: not valid JSON: {error}") from None
            if not isinstance(schema, dict | bool):
                raise InvalidArgumentError(f"{where}: a JSON Schema is an object or a boolean")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except Exception as error:  # llguidance raises ValueError/RuntimeError with its reason
            raise InvalidArgumentError(f"{where}: cannot be compiled: {error}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer())
        if is_error:
            reason = "; ".join(message.strip() for message in messages) or "unknown error"
            raise InvalidArgumentError(f"{where}: cannot be enforced (llguidance): {reason}")
        return grammar

    def constraint(self, response_format: ResponseFormat) -> Constraint:
        """A fresh matcher for one sequence (compiles; run it off the event loop)."""
        grammar = self.grammar(response_format)
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar)
        if matcher.is_error():
            raise InvalidArgumentError(
                f"response_format.json_schema.schema: cannot be enforced (llguidance): {matcher.get_error()}"
            )
        return Constraint(matcher=matcher, eos_ids=frozenset(self._eos_ids))


@dataclass(slots=True, eq=False)
class Constraint:
    """One sequence's grammar state. `consumed` counts the tokens its matcher has taken;
    `base` is how many of them came before the manager's current submission (a preempted
    sequence is re-submitted with its tokens in the prompt and counts from zero again)."""

    matcher: Any
    eos_ids: frozenset[int]
    consumed: int = 0
    base: int = 0
    broken: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def catch_up(self, tokens: Sequence[int], *, offset: int = 0) -> None:
        """Consume `tokens[consumed - offset:]` (the sequence's tokens since `offset`)."""
        with self.lock:
            for token in tokens[self.consumed - offset :]:
                self.consumed += 1
                if self.broken or token in self.eos_ids:
                    continue
                if not self.matcher.consume_token(int(token)):
                    # Cannot happen while the mask is applied; said loudly if it does.
                    self.broken = self.matcher.get_error() or f"token {token} rejected"
                    log.error("grammar matcher rejected a generated token: %s", self.broken)

    def resubmitted(self, tokens: Sequence[int]) -> None:
        """The sequence goes on in a new submission whose prompt ends with `tokens` (all it
        generated so far): consume any the matcher has not seen (or roll back one it took
        from an output that was dropped at preemption), then count from there."""
        with self.lock:
            if self.consumed > len(tokens) and not self.broken:
                self.matcher.rollback(self.consumed - len(tokens))
                self.consumed = len(tokens)
        self.catch_up(tokens)
        with self.lock:
            self.base = self.consumed

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits of the next token into `bitmask[row]` (CPU int32,
        contiguous). `llguidance.torch` does the same, but importing it imports
        torch._dynamo (seconds) for a compiled helper we do not use."""
        target = bitmask[row]
        with self.lock:
            self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())


class GrammarMask(ContinuousBatchingLogitsProcessor):
    """The manager's first logits processor: constrained rows keep only what their grammar
    allows. Sequences are looked up by the manager's request id (`attach` / `detach` from the
    event loop; the manager's thread reads). Runs `prepare_tensor_args` then `__call__` for the
    same batch on the manager's thread (synchronous batching)."""

    supported_kwargs: dict[str, type] = {}
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, vocab_size: int) -> None:
        self._vocab_size = vocab_size
        self._live: dict[str, Constraint] = {}
        self._bitmask: torch.Tensor | None = None  # [rows, words] for the batch being run

    def attach(self, request_id: str, constraint: Constraint) -> None:
        self._live[request_id] = constraint

    def detach(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def move(self, old_id: str, new_id: str, tokens: Sequence[int]) -> None:
        """A preempted sequence is re-submitted as `new_id` with `tokens` generated so far."""
        constraint = self._live.pop(old_id, None)
        if constraint is not None:
            constraint.resubmitted(tokens)
            self._live[new_id] = constraint

    @property
    def attached(self) -> int:
        return len(self._live)

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        self._bitmask = None
        flags = torch.zeros(len(requests_with_new_token), dtype=torch.int32)
        if not self._live:
            return flags
        for row, request in enumerate(requests_with_new_token):
            constraint = self._live.get(request.state.request_id)
            if constraint is None:
                continue
            if self._bitmask is None:  # every bit set: unconstrained rows keep every token
                words = (self._vocab_size + 31) // 32
                self._bitmask = torch.full((len(requests_with_new_token), words), -1, dtype=torch.int32)
            constraint.catch_up(request.state.generated_tokens, offset=constraint.base)
            constraint.fill(self._bitmask, row)
            flags[row] = 1
        return flags

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        bitmask = self._bitmask
        if bitmask is None:
            return scores
        # The batch's rows are its sequences with a new token first, in order; a sequence
        # still prefilling its prompt in chunks adds a row after them that nothing samples
        # from (transformers computes logits for every sequence), left as it is.
        rows = min(scores.size(0), bitmask.size(0))
        allowed = ((bitmask[:rows].unsqueeze(-1) >> _BITS) & 1).view(rows, -1)[:, : scores.size(-1)]
        allowed = allowed.to(device=scores.device, dtype=torch.bool)
        if allowed.size(-1) < scores.size(-1):  # the model's vocab is larger than the grammar's
            pad = torch.zeros(
                rows, scores.size(-1) - allowed.size(-1), dtype=torch.bool, device=scores.device
            )
            allowed = torch.cat([allowed, pad], dim=-1)
        if rows < scores.size(0):
            free = torch.ones(scores.size(0) - rows, scores.size(-1), dtype=torch.bool, device=scores.device)
            allowed = torch.cat([allowed, free], dim=0)
        return scores.masked_fill(~allowed, float("-inf"))


class CheckedStream(GenerationStream):
    """A constrained generation's stream: if its grammar matcher rejected a generated token
    (the reply can no longer be valid), a "stop" terminal becomes an error that says so,
    never a reply that claims to be complete JSON."""

    def __init__(self, stream: GenerationStream, constraint: Constraint) -> None:
        super().__init__(stream._state, stream._cancel)
        self._constraint = constraint

    async def __anext__(self) -> GenerationEvent:
        return self._checked(await super().__anext__())

    def ready(self) -> list[GenerationEvent]:
        return [self._checked(event) for event in super().ready()]

    def _checked(self, event: GenerationEvent) -> GenerationEvent:
        broken = self._constraint.broken
        if isinstance(event, GenerationEnd) and broken and event.finish_reason is FinishReason.STOP:
            return dataclasses.replace(
                event,
                finish_reason=FinishReason.ERROR,
                error=f"structured output: the grammar rejected a generated token ({broken})",
            )
        return event


def refusal(config: Any) -> str | None:
    """Why a manager built with this (resolved) `ContinuousBatchingConfig` cannot enforce a
    grammar, or None. With async batching the next step is prepared before the current one's
    token is known (so no matcher can say what may follow); a captured CUDA graph would replay
    a stale mask. Both are GPU-only choices; the CPU path has neither."""
    if getattr(config, "use_async_batching", False):
        return "its continuous batching is asynchronous (set use_async_batching off to serve response_format)"
    if any(getattr(config, "cuda_graph_booleans", (False, False))):
        return "its continuous batching captures CUDA graphs (turn them off to serve response_format)"
    return None


def install(processors: Any, mask: GrammarMask) -> None:
    """Put `mask` first in a manager's `ContinuousBatchingLogitsProcessorList` (before start)."""
    processors.logits_processor.insert(0, mask)
    processors.tensors_required += 1
    processors._retrieve_processors_kwargs()
    processors.do_processing = True
