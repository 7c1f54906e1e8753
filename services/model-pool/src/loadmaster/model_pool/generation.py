"""Generation domain values and the pure pieces of a token stream.

A generative engine (`engines/transformers.py`) takes a `GenerationRequest` and answers
with a stream of events: `TokenChunk`s (sequence numbers 0, 1, 2, ...) then exactly one
`GenerationEnd` (the next sequence number) whose `finish_reason` says why it ended:

    STOP       the model's end-of-sequence token, or one of the request's stop strings
    LENGTH     `max_tokens` generated
    CANCELLED  the caller cancelled it (its sequence slot is freed at the next decode step)
    ERROR      the engine failed it (`error` says why); nothing after this

The stream contract (also in model_pool.proto and docs/generative.md): chunk sequence
numbers start at 0 and grow by one; the terminal follows the last chunk; nothing follows
the terminal. A consumer checks order and exactly-once with the sequence numbers alone.

With `n` > 1 a request has several choices: every chunk names its `choice`, and the one
terminal comes after the last choice ended, with how each ended (`GenerationEnd.choices`).
Tools (`ToolUse`) and log probabilities (`TokenChunk.logprobs`, `TokenLogprob`) are
docs/tool-calling.md.

Pure code only: `SamplingParams.check` validates, `StopMatcher` finds stop strings across
chunk boundaries and holds back text that could still become one.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from loadmaster.common.errors import InvalidArgumentError

__all__ = [
    "CHAT_ROLES",
    "MAX_CHOICES",
    "MAX_STOP_STRINGS",
    "MAX_TOOLS",
    "MAX_TOP_LOGPROBS",
    "ChatMessage",
    "ChoiceEnd",
    "FinishReason",
    "FunctionTool",
    "GenerationEnd",
    "GenerationEvent",
    "GenerationRequest",
    "GenerationStats",
    "ResponseFormat",
    "SamplingParams",
    "StopMatcher",
    "TokenChunk",
    "TokenLogprob",
    "ToolCall",
    "ToolChoice",
    "ToolUse",
    "TopLogprob",
    "Usage",
]

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_TOOLS = 128  # as OpenAI's API
MAX_TOP_LOGPROBS = 20  # as OpenAI's API
MAX_CHOICES = 64  # the gateway's `max_n` is lower (default 8)
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
_SEED_MAX = (1 << 63) - 1


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"  # the reply is tool calls (it may have text before them)
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call of a function: made by the model in this reply, or earlier (chat history).
    `arguments` is JSON text (an object), as OpenAI's API carries it."""

    id: str
    name: str
    arguments: str
    index: int = 0  # its place among the reply's calls


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str = ""  # a tool turn: the call it answers
    name: str = ""  # a tool turn: the function that answered
    images: tuple[bytes, ...] = ()  # encoded images shown before `content` (engines that take images)


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """A function the model may call; `parameters` is its JSON Schema as JSON text ("" = takes
    no arguments: only `{}`)."""

    name: str
    description: str = ""
    parameters: str = ""
    strict: bool = False

    def schema(self) -> dict[str, object] | bool:
        """The parsed `parameters` (the empty object's schema when none was given)."""
        if not self.parameters:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        value = json.loads(self.parameters)
        if not isinstance(value, dict | bool):
            raise ValueError("a JSON Schema is an object")
        return value  # type: ignore[no-any-return]


class ToolChoice(StrEnum):
    AUTO = "auto"  # the model decides; calls are parsed out of its text (its `tool_format`)
    NONE = "none"  # tools are shown to the model, but the reply is text
    REQUIRED = "required"  # at least one call of any tool, decoding constrained
    FUNCTION = "function"  # a call of `function_name`, decoding constrained


@dataclass(frozen=True, slots=True)
class ToolUse:
    """The tools of one request and how they may be called (docs/tool-calling.md)."""

    functions: tuple[FunctionTool, ...]
    choice: ToolChoice = ToolChoice.AUTO
    function_name: str = ""
    parallel: bool = True  # more than one call per reply

    @property
    def constrained(self) -> bool:
        """Whether the reply must be tool calls (decoding is constrained to them)."""
        return self.choice in (ToolChoice.REQUIRED, ToolChoice.FUNCTION)

    def called(self) -> tuple[FunctionTool, ...]:
        """The functions a constrained reply may call."""
        if self.choice is ToolChoice.FUNCTION:
            return tuple(f for f in self.functions if f.name == self.function_name)
        return self.functions

    def check(self) -> None:
        if not self.functions:
            raise InvalidArgumentError("tools: at least one function is required")
        if len(self.functions) > MAX_TOOLS:
            raise InvalidArgumentError(f"tools: {len(self.functions)} functions, at most {MAX_TOOLS}")
        names: set[str] = set()
        for index, function in enumerate(self.functions):
            if not FUNCTION_NAME.match(function.name):
                raise InvalidArgumentError(
                    f"tools[{index}].function.name: {function.name!r} is not 1-64 letters, digits, _ or -"
                )
            if function.name in names:
                raise InvalidArgumentError(f"tools[{index}].function.name: {function.name!r} is repeated")
            names.add(function.name)
            try:
                function.schema()
            except ValueError as error:
                raise InvalidArgumentError(f"tools[{index}].function.parameters: {error}") from None
        if not isinstance(self.choice, ToolChoice):
            raise InvalidArgumentError(f"tool_choice: {self.choice!r} is not one of auto, none, required")
        if self.choice is ToolChoice.FUNCTION and self.function_name not in names:
            raise InvalidArgumentError(
                f"tool_choice.function.name: {self.function_name!r} is not one of the tools"
            )


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    token: bytes  # the token's bytes (may be part of a UTF-8 character)
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log probability in the distribution it was drawn from, and the
    `top` most likely tokens of that distribution (most likely first)."""

    token_id: int
    token: bytes
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling. `temperature` 0 is greedy decoding (exactly `argmax`).

    `seed` makes a sampled reply reproducible: the engine draws each token with noise that
    depends only on (seed, the token's position), never on the other sequences in the batch.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def check(self) -> None:
        """Raise `InvalidArgumentError` naming the first bad field."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens: {self.max_tokens!r} is not an integer >= 1")
        if not _finite(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise InvalidArgumentError(f"temperature: {self.temperature!r} is not a number in [0, 2]")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError(f"top_p: {self.top_p!r} is not a number in (0, 1]")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not -_SEED_MAX <= self.seed <= _SEED_MAX
        ):
            raise InvalidArgumentError(f"seed: {self.seed!r} is not a 64-bit integer")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidArgumentError(f"stop: {len(self.stop)} strings, at most {MAX_STOP_STRINGS}")
        for index, text in enumerate(self.stop):
            if not isinstance(text, str) or not text:
                raise InvalidArgumentError(f"stop[{index}]: {text!r} is not a non-empty string")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """Structured output: the reply must be JSON (`json_object`) or JSON valid against
    `schema` (`json_schema`, the schema as JSON text). The engine enforces it while decoding
    (`engines/grammar.py`); a schema it cannot compile is an `InvalidArgumentError`."""

    kind: str  # "json_object" | "json_schema"
    schema: str = ""
    name: str = ""

    def check(self) -> None:
        if self.kind not in ("json_object", "json_schema"):
            raise InvalidArgumentError(
                f"response_format.type: {self.kind!r} is not one of text, json_object, json_schema"
            )
        if self.kind == "json_schema" and not self.schema:
            raise InvalidArgumentError("response_format.json_schema.schema: missing")


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation: exactly one of `prompt_token_ids`, `prompt` (text) or `messages`
    (rendered with the model's chat template, with the assistant's turn opened).

    `priority` (0 is the most urgent), `tenant` and `tenant_weight` decide its place in the
    engine's queue (generation_order.py)."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    response_format: ResponseFormat | None = None
    priority: int = 1
    tenant: str = ""
    tenant_weight: float = 1.0
    # Extra variables for the chat template (`enable_thinking` …); chat messages only.
    chat_template_kwargs: Mapping[str, Any] | None = None
    tools: ToolUse | None = None
    logprobs: int | None = None  # None: none; k: each token's, and its k most likely alternatives
    n: int = 1  # choices from the one prompt

    @property
    def tool_calls_parsed(self) -> bool:
        """Whether tool calls are read out of the reply (tools given, `tool_choice` not none)."""
        return self.tools is not None and self.tools.choice is not ToolChoice.NONE

    @property
    def images(self) -> int:
        """How many images the messages carry."""
        return sum(len(m.images) for m in self.messages or ())

    def check(self) -> None:
        if not self.request_id:
            raise InvalidArgumentError("request_id: empty")
        given = [
            name for name in ("prompt_token_ids", "prompt", "messages") if getattr(self, name) is not None
        ]
        if len(given) != 1:
            raise InvalidArgumentError(
                f"give exactly one of prompt_token_ids, prompt or messages (got {', '.join(given) or 'none'})"
            )
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise InvalidArgumentError("prompt_token_ids: empty")
        if self.prompt is not None and not self.prompt:
            raise InvalidArgumentError("prompt: empty")
        if self.messages is not None:
            if not self.messages:
                raise InvalidArgumentError("messages: empty")
            for index, message in enumerate(self.messages):
                if message.role not in CHAT_ROLES:
                    raise InvalidArgumentError(
                        f"messages[{index}].role: {message.role!r} is not one of {', '.join(sorted(CHAT_ROLES))}"
                    )
                if not isinstance(message.content, str):
                    raise InvalidArgumentError(f"messages[{index}].content: not a string")
        if self.chat_template_kwargs is not None:
            if self.messages is None:
                raise InvalidArgumentError(
                    "chat_template_kwargs: only chat messages are rendered with a template"
                )
            if not all(isinstance(key, str) for key in self.chat_template_kwargs):
                raise InvalidArgumentError("chat_template_kwargs: keys are strings")
        if self.response_format is not None:
            self.response_format.check()
        if self.tools is not None:
            if self.messages is None:
                raise InvalidArgumentError("tools: only a chat (messages) can use tools")
            self.tools.check()
            if self.tools.constrained and self.response_format is not None:
                raise InvalidArgumentError(
                    "response_format: cannot be combined with tool_choice required or a named function"
                )
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            raise InvalidArgumentError(f"top_logprobs: {self.logprobs!r} is not in 0..{MAX_TOP_LOGPROBS}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_CHOICES:
            raise InvalidArgumentError(f"n: {self.n!r} is not in 1..{MAX_CHOICES}")
        self.params.check()


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """New tokens of one stream and the text they complete (may be "" while a multi-byte
    character or a possible stop string is still open)."""

    request_id: str
    sequence: int
    token_ids: tuple[int, ...]
    text: str
    choice: int = 0  # which of the request's `n` choices
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when asked for
    tool_calls: tuple[ToolCall, ...] = ()  # calls completed here (`text` holds none of their text)


@dataclass(frozen=True, slots=True)
class ChoiceEnd:
    """How one of a request's `n` choices ended."""

    index: int
    finish_reason: FinishReason
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class GenerationEnd:
    """The one terminal event of a stream."""

    request_id: str
    sequence: int
    finish_reason: FinishReason
    usage: Usage
    error: str = ""
    choices: tuple[ChoiceEnd, ...] = ()  # with n > 1: each choice's end (usage sums them)


GenerationEvent = TokenChunk | GenerationEnd


@dataclass(frozen=True, slots=True)
class GenerationStats:
    """A snapshot of an engine's sequences and KV cache, for metrics and status."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    preemptions: int = 0
    streams_open: int = 0
    # prefix reuse (engines/_prefix_cache.py): counters since load, and pages cached now
    prefix_lookups: int = 0
    prefix_hits: int = 0
    prefix_tokens_reused: int = 0
    prefix_blocks_evicted: int = 0
    prefix_blocks_cached: int = 0


@dataclass(slots=True)
class StopMatcher:
    """Finds the first stop string in a stream of text pieces.

    `feed(text)` returns the text that is safe to emit and whether a stop string was
    found (then the text before it is returned and nothing more may be fed). Text that
    could be the start of a stop string is held back until it cannot; `flush()` returns
    it when the stream ends for another reason. The stop string itself is never emitted.
    """

    stops: Sequence[str]
    _held: str = field(default="")

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buffer = self._held + text
        found = [index for index in (buffer.find(stop) for stop in self.stops) if index >= 0]
        if found:
            self._held = ""
            return buffer[: min(found)], True
        keep = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(buffer)), keep, -1):
                if buffer.endswith(stop[:length]):
                    keep = length
                    break
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
