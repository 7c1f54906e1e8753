"""The protocol-neutral pieces of a generation beyond its text: chat turns with tool calls,
the tools a request offers, the calls and log probabilities a reply carries, and how each of
its `n` choices ended.

Every front end (OpenAI's chat, completions and responses; the Ollama and Anthropic dialects)
translates its own shapes into these and back; `GenerationStreams` carries them to and from
the worker (`GenerateRequest.tools`, `TokenChunk.tool_calls`, `TokenChunk.logprobs`,
`GenerationResult.choices` in model_pool.proto). docs/tool-calling.md has the design.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "LOGPROB_FLOOR",
    "ChatTurn",
    "ChoiceEnd",
    "FunctionSpec",
    "TokenLogprob",
    "ToolCall",
    "ToolChoice",
    "ToolUse",
    "TopLogprob",
]

ToolChoice = Literal["auto", "none", "required", "function"]
# What a log probability of minus infinity (a token the sampler could not draw) is reported
# as: JSON has no infinity, and OpenAI's own API answers -9999.0 for it.
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call: made by the model in a reply, or an earlier one in a chat's history.
    `arguments` is JSON text (an object), as OpenAI's API carries it; `index` is its place
    among the reply's calls."""

    id: str
    name: str
    arguments: str
    index: int = 0

    def arguments_object(self) -> Any:
        """`arguments` parsed (the dialects that carry an object rather than text use it)."""
        return json.loads(self.arguments) if self.arguments else {}


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One message of a chat: a role and its text; an assistant turn may carry the calls it
    made, a `tool` turn answers the call `tool_call_id` (of function `name`)."""

    role: str  # system | user | assistant | tool ("developer" arrives as system)
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    """A function the model may call; `parameters` is its JSON Schema (None: no arguments)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool = False


@dataclass(frozen=True, slots=True)
class ToolUse:
    """A request's tools and how they may be called: `auto` (the model decides; its calls are
    read out of its text in the model's `tool_format`), `none` (text only), `required` (at
    least one call, decoding constrained to the tools' schemas) or `function` (a call of
    `function_name`, constrained). `parallel`: more than one call in one reply."""

    functions: tuple[FunctionSpec, ...]
    choice: ToolChoice = "auto"
    function_name: str = ""
    parallel: bool = True


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token: str  # the token's text (its bytes decoded, a partial character replaced)
    bytes: bytes
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log probability in the distribution the sampler drew it from, and
    that distribution's most likely tokens (most likely first)."""

    token: str
    bytes: bytes
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class ChoiceEnd:
    """How one of a request's `n` choices ended (`stop`, `length`, `tool_calls`)."""

    index: int
    finish_reason: str
    completion_tokens: int
