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

Pure code only: `SamplingParams.check` validates, `StopMatcher` finds stop strings across
chunk boundaries and holds back text that could still become one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from loadmaster.common.errors import InvalidArgumentError

__all__ = [
    "CHAT_ROLES",
    "MAX_STOP_STRINGS",
    "ChatMessage",
    "FinishReason",
    "GenerationEnd",
    "GenerationEvent",
    "GenerationRequest",
    "GenerationStats",
    "ResponseFormat",
    "SamplingParams",
    "StopMatcher",
    "TokenChunk",
    "Usage",
]

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_STOP_STRINGS = 4  # as OpenAI's API
_SEED_MAX = (1 << 63) - 1


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    images: tuple[bytes, ...] = ()  # encoded images shown before `content` (engines that take images)


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
    (rendered with the model's chat template, with the assistant's turn opened)."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    response_format: ResponseFormat | None = None

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
        if self.response_format is not None:
            self.response_format.check()
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


@dataclass(frozen=True, slots=True)
class GenerationEnd:
    """The one terminal event of a stream."""

    request_id: str
    sequence: int
    finish_reason: FinishReason
    usage: Usage
    error: str = ""
    preemptions: int = 0  # times the sequence was paused for other work and resumed


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
