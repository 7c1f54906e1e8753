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
grammar allows only end-of-sequence, so the reply ends with finish_reason "stop".

The value always completes within `max_tokens` (`_json_budget.py`): numbers are bounded to
what a double holds (`_json_bounds.py`), the shortest reply is searched at submit (a budget
it does not fit in is an `InvalidArgumentError` naming max_tokens, before anything is
queued), the mask allows only the plan's next token when no slack is left, and
`BudgetGuard`, the last processor, checks every other sampled token against the budget.

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
from collections import OrderedDict
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
from loadmaster.model_pool.engines._json_bounds import bounded_object, bounded_schema
from loadmaster.model_pool.engines._json_budget import Budget, Vocabulary
from loadmaster.model_pool.engines._json_closing import Closer
from loadmaster.model_pool.engines._json_shape import SchemaIndex
from loadmaster.model_pool.engines._token_streams import GenerationStream
from loadmaster.model_pool.generation import FinishReason, GenerationEnd, GenerationEvent, ResponseFormat

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["BudgetGuard", "CheckedStream", "Constraint", "GrammarMask", "JsonGrammars", "install", "refusal"]

log = logging.getLogger(__name__)

# Compact JSON: no whitespace between tokens, "," and ":" as separators.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
_BITS = torch.arange(32, dtype=torch.int32)
_PLANS_KEPT = 256  # schemas whose shortest reply is remembered
_UNPLANNED = object()


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
        self._vocabulary: Vocabulary | None = None
        self._plans: OrderedDict[str, tuple[SchemaIndex, bytes | None]] = OrderedDict()
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

    def _planned(self, grammar: str, schema: Any) -> tuple[SchemaIndex, bytes | object | None]:
        """The schema's index and the shortest reply found before for this grammar (the
        start state is the same for every request: searched once per schema), or
        `_UNPLANNED`."""
        with self._lock:
            found = self._plans.get(grammar)
            if found is not None:
                self._plans.move_to_end(grammar)
                return found
            while len(self._plans) >= _PLANS_KEPT:
                self._plans.popitem(last=False)
        return SchemaIndex(schema), _UNPLANNED

    def vocabulary(self) -> Vocabulary:
        tokenizer = self.tokenizer()
        with self._lock:
            if self._vocabulary is None:
                self._vocabulary = Vocabulary(tokenizer, eos_ids=self._eos_ids)
            return self._vocabulary

    def schema(self, response_format: ResponseFormat) -> Any:
        """The JSON Schema a response format enforces, its numbers bounded to what a double
        holds (`_json_bounds.py`); `InvalidArgumentError` when it is not a schema."""
        response_format.check()
        if self._refused:
            raise InvalidArgumentError(f"response_format: not available on this model: {self._refused}")
        if response_format.kind != "json_schema":
            return bounded_object()
        where = "response_format.json_schema.schema"
        try:
            schema = json.loads(response_format.schema)
        except ValueError as error:
            raise InvalidArgumentError(f"{where}: not valid JSON: {error}") from None
        if not isinstance(schema, dict | bool):
            raise InvalidArgumentError(f"{where}: a JSON Schema is an object or a boolean")
        return bounded_schema(schema)

    def grammar(self, response_format: ResponseFormat, schema: Any = None) -> str:
        """The llguidance grammar of a response format (of `schema`, its bounded schema,
        when given); `InvalidArgumentError` naming the problem when the schema is not JSON
        or llguidance cannot compile it."""
        if schema is None:
            schema = self.schema(response_format)
        where = "response_format.json_schema.schema"
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except Exception as error:  # llguidance raises ValueError/RuntimeError with its reason
            raise InvalidArgumentError(f"{where}: cannot be compiled: {error}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer())
        if is_error:
            reason = "; ".join(message.strip() for message in messages) or "unknown error"
            raise InvalidArgumentError(f"{where}: cannot be enforced (llguidance): {reason}")
        return grammar

    def constraint(self, response_format: ResponseFormat, *, max_tokens: int | None = None) -> Constraint:
        """A fresh matcher for one sequence and, with `max_tokens`, its budget: the shortest
        valid reply is searched now, and when it needs more than `max_tokens` (its
        end-of-sequence token included) the request is refused with an
        `InvalidArgumentError` naming max_tokens (compiles and searches: run it off the
        event loop)."""
        schema = self.schema(response_format)
        grammar = self.grammar(response_format, schema)
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar)
        if matcher.is_error():
            raise InvalidArgumentError(
                f"response_format.json_schema.schema: cannot be enforced (llguidance): {matcher.get_error()}"
            )
        constraint = Constraint(matcher=matcher, eos_ids=frozenset(self._eos_ids))
        if max_tokens is None:
            return constraint
        index, shortest = self._planned(grammar, schema)
        budget = Budget(Closer(grammar, schema, index), self.vocabulary())
        try:
            plan = budget.shortest() if shortest is _UNPLANNED else budget.start(shortest)  # type: ignore[arg-type]
        except Exception:  # a bug of ours must not refuse the request: served unplanned
            log.exception("structured output: planning the reply failed")
            return constraint
        with self._lock:
            self._plans[grammar] = (index, None if plan is None else plan.text)
        if plan is None:  # the search gave up: enforced as before, without the budget
            log.warning("no closing path found for a response_format; its budget is not planned")
            return constraint
        if plan.need > max_tokens:
            raise InvalidArgumentError(
                f"max_tokens: {max_tokens} is too small for a reply valid against response_format: "
                f"the shortest takes {plan.need} tokens (its end-of-sequence token included)"
            )
        constraint.budget = budget
        return constraint


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
    budget: Budget | None = None  # the token budget (`_json_budget.py`), when planned
    taken: list[int] = field(default_factory=list)  # the tokens the matcher took
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
                    continue
                self.taken.append(int(token))
                if self.budget is not None:
                    self._budgeted(self.budget.feed, int(token))

    def resubmitted(self, tokens: Sequence[int]) -> None:
        """The sequence goes on in a new submission whose prompt ends with `tokens` (all it
        generated so far): consume any the matcher has not seen (or roll back one it took
        from an output that was dropped at preemption), then count from there. A plan lost
        to a rollback is searched again at the next step, on the manager's thread (this runs
        on the event loop)."""
        with self.lock:
            if self.consumed > len(tokens) and not self.broken:
                count = self.consumed - len(tokens)
                dropped = self.taken[len(self.taken) - min(count, len(self.taken)) :]
                self.matcher.rollback(len(dropped))
                del self.taken[len(self.taken) - len(dropped) :]
                if self.budget is not None:
                    self._budgeted(self.budget.rollback, dropped)
                self.consumed = len(tokens)
        self.catch_up(tokens)
        with self.lock:
            self.base = self.consumed

    def remaining(self, state: Any) -> int | None:
        """Tokens this step and the ones after it may still take, from the manager's state."""
        limit = getattr(state, "max_new_tokens", None)
        return None if limit is None else int(limit) - len(state.generated_tokens)

    def forced(self, remaining: int | None) -> int | None:
        """The token this step must take to finish within budget, if it has no choice
        (searching the plan first when a preemption lost it)."""
        budget = self.budget
        if remaining is None or budget is None or self.broken:
            return None
        with self.lock:
            if budget.plan is None:
                self._budgeted(budget.shortest)
            return self._budgeted(budget.forced, remaining)

    def approve(self, token: int, remaining: int) -> int:
        """The token to emit for a sampled one (`Budget.approve`)."""
        budget = self.budget
        if budget is None or self.broken:
            return token
        with self.lock:
            approved = self._budgeted(budget.approve, token, remaining)
            return token if approved is None else approved

    def _budgeted(self, call: Any, *args: Any) -> Any:
        """A budget step on the manager's thread, which must never die of it: an error in
        the budget's code drops the budget (the grammar still holds, as without one)."""
        try:
            return call(*args)
        except Exception:
            log.exception("structured output: the token budget failed; this reply goes on without it")
            self.budget = None
            return None

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits of the next token into `bitmask[row]` (CPU int32,
        contiguous). `llguidance.torch` does the same, but importing it imports
        torch._dynamo (seconds) for a compiled helper we do not use."""
        target = bitmask[row]
        with self.lock:
            self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())


class GrammarMask(ContinuousBatchingLogitsProcessor):
    """The manager's first logits processor: constrained rows keep only what their grammar
    allows (only their plan's next token when their budget leaves no choice). Sequences are
    looked up by the manager's request id (`attach` / `detach` from the event loop; the
    manager's thread reads). Runs `prepare_tensor_args` then `__call__` for the same batch on
    the manager's thread (synchronous batching); `guard`, the last processor, checks the
    tokens sampled on the rows it lists."""

    supported_kwargs: dict[str, type] = {}
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, vocab_size: int) -> None:
        self._vocab_size = vocab_size
        self._live: dict[str, Constraint] = {}
        self._bitmask: torch.Tensor | None = None  # [rows, words] for the batch being run
        self.checks: list[tuple[int, Constraint, int]] = []  # (row, constraint, remaining)
        self.guard = BudgetGuard(self)

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
        self.checks = []
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
            remaining = constraint.remaining(request.state)
            forced = constraint.forced(remaining)
            if forced is not None:
                _only(self._bitmask, row, forced)
            else:
                constraint.fill(self._bitmask, row)
                if remaining is not None and constraint.budget is not None:
                    self.checks.append((row, constraint, remaining))
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


class BudgetGuard(ContinuousBatchingLogitsProcessor):
    """The manager's last logits processor, after the seeded sampler has kept one token per
    row: on each constrained row with slack, the sampled token stands if the value can
    still finish after it within the budget, else the plan's next token replaces it
    (`Budget.approve`). The row leaves with exactly that token finite, so the manager's own
    sampling takes it."""

    supported_kwargs: dict[str, type] = {}
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, mask: GrammarMask) -> None:
        self._mask = mask

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        return torch.zeros(len(requests_with_new_token), dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        checks = self._mask.checks
        if not checks:
            return scores
        rows = [row for row, _, _ in checks if row < scores.size(0)]
        picked = scores[rows]
        chosen = picked.argmax(dim=-1).tolist()
        single = torch.isfinite(picked).sum(dim=-1).eq(1).tolist()  # the sampler kept one
        for (row, constraint, remaining), sampled, alone in zip(checks, chosen, single, strict=False):
            token = constraint.approve(int(sampled), remaining)
            if token != sampled or not alone:
                scores[row].fill_(float("-inf"))
                scores[row, token] = 0.0
        return scores


def _only(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Allow only `token` on `bitmask[row]`."""
    bitmask[row].fill_(0)
    word, bit = divmod(token, 32)
    if 0 <= word < bitmask.size(1):
        bitmask[row, word] = (1 << bit) if bit < 31 else -(1 << 31)  # int32 bits


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
    """Put `mask` first and its budget guard last in a manager's
    `ContinuousBatchingLogitsProcessorList` (before start; after `_seeded_sampling.install`,
    so that the guard sees the token the seeded sampler kept)."""
    processors.logits_processor.insert(0, mask)
    processors.logits_processor.append(mask.guard)
    processors.tensors_required += 2
    processors._retrieve_processors_kwargs()
    processors.do_processing = True
