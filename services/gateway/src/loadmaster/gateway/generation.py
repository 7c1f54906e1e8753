"""A generation as the gateway's core sees it, whatever front end it came through.

Every front end that generates text (OpenAI's chat, completions and responses routes, the
Ollama and Anthropic dialects, KServe's `text_input` models) translates its body into one
`GenerationRequest` and reads back one stream of `GenerationEvent`s: `Waiting` while it waits,
`TextChunk`s, then exactly one `Finished` (or a raised `LoadmasterError`). It talks to the rest
of the gateway through two ports: `Generations` (run it: `generations.GenerationRouter`) and
`RequestPolicy` (admit it, watch its events: `request_policy.GatewayPolicy`). A request refused
before it runs is a `RequestError` with an HTTP status; each front end gives it its own shape.
Nothing here imports a front end (docs/design/gateway.md).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from loadmaster.gateway.auth import Principal
from loadmaster.gateway.generation_items import ChatTurn, ChoiceEnd, TokenLogprob, ToolCall, ToolUse

__all__ = [
    "MAX_CONTENT_PARTS",
    "MAX_MESSAGES",
    "ChatImage",
    "Finished",
    "GenerationEvent",
    "GenerationRequest",
    "Generations",
    "RequestError",
    "RequestPolicy",
    "RequestWatch",
    "TextChunk",
    "Unwatched",
    "Waiting",
]


# Messages of one chat request, and content parts (text, images) of one message, on every front
# end. Parsing a body and building its messages hold the gateway's event loop for time that grows
# with these counts, not with bytes: 100,000 small messages in a 4 MiB body held it ~350 ms, and
# a thread would not help (the interpreter is held). With these bounds pydantic stops at the
# first list over them (docs/frontend-isolation.md, docs/limits.md).
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256


class RequestError(Exception):
    """A request refused before it runs: an HTTP `status`, the field at fault (`param`) and a
    `code`, in whatever shape its front end answers errors."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class ChatImage:
    """An image of chat message `message`: its `url` as sent, and its encoded bytes once
    the gateway fetched and checked them (loadmaster.gateway.chat_images)."""

    message: int
    url: str
    data: bytes = b""


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation as the dispatcher sees it: either chat `messages` or a text `prompt`;
    `tools`, `logprobs` (None: none; k: each token's and its k most likely alternatives) and
    `n` choices (loadmaster.gateway.generation_items)."""

    model: str
    messages: tuple[ChatTurn, ...] | None
    prompt: str | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    response_format: dict[str, Any] | None
    client_id: str | None
    priority: int | None
    urgency: float | None
    deadline_ms: float | None
    user: str | None
    chat_template_kwargs: dict[str, Any] | None = None  # chat only; the model's template reads them
    tools: ToolUse | None = None
    logprobs: int | None = None
    n: int = 1
    # Images of the chat messages, in order (message index, URL; `data` once fetched).
    images: tuple[ChatImage, ...] = ()
    keep_alive_s: float | None = None


@dataclass(frozen=True, slots=True)
class TextChunk:
    """Text decoded since the previous chunk (may be empty when a token completes no character),
    of choice `choice`; the tool calls completed in it, and its tokens' log probabilities when
    they were asked for."""

    text: str
    model: str = ""  # the model generating it, when it differs from the one asked (an alias)
    choice: int = 0
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Finished:
    """The end of a generation: `stop`, `length`, `tool_calls` (or `cancelled`), with the token
    counts; with n > 1, how each choice ended (`choices`)."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    model: str = ""  # the model that answered, when it differs from the one asked (an alias)
    choices: tuple[ChoiceEnd, ...] = ()

    def choice_ends(self, n: int) -> tuple[ChoiceEnd, ...]:
        """How each of `n` choices ended (one choice: this end itself)."""
        if self.choices:
            return self.choices
        return tuple(ChoiceEnd(i, self.finish_reason, self.completion_tokens) for i in range(max(1, n)))


@dataclass(frozen=True, slots=True)
class Waiting:
    """Where a stream that has not started stands (docs/generation-scheduling.md): `queued_ahead`
    requests ahead of it, or its model loading (`load_fraction` of the last measured load time,
    None when none was measured). A stream shows it as an SSE comment; nothing else does."""

    queued_ahead: int = 0
    loading: bool = False
    load_fraction: float | None = None

    def comment(self) -> bytes:
        if not self.loading:
            return f": queued {self.queued_ahead}\n\n".encode()
        if self.load_fraction is None:
            return b": loading\n\n"
        return f": loading {min(99, int(self.load_fraction * 100))}%\n\n".encode()


GenerationEvent = TextChunk | Finished | Waiting


class Generations(Protocol):
    """What the front end needs from the rest of the gateway."""

    def generate(
        self, request: GenerationRequest, *, request_id: str, client_id: str, tenant: str = ""
    ) -> AsyncIterator[GenerationEvent]:
        """`Waiting` while it waits, chunks, then one `Finished`; raises `LoadmasterError`.
        Closing it early cancels."""
        ...

    async def models(self) -> dict[str, str]:
        """The generative models served, by id, with their state (READY, LOADING, IDLE …)."""
        ...


class RequestWatch(Protocol):
    """One completion request, seen by the gateway's policy: told who asked, asked to admit
    the request, and given its events to pass on (checked, recorded); `failed` ends it early."""

    def authenticated(self, principal: Principal) -> None: ...

    async def admit(self, generation: GenerationRequest, *, client_id: str) -> GenerationRequest:
        """Refuse the request (raise), or return it as the gateway will run it (a client
        profile's defaults filled in)."""
        ...

    def watch(self, events: AsyncIterator[GenerationEvent]) -> AsyncIterator[GenerationEvent]: ...

    def failed(self, error: BaseException) -> None: ...


class RequestPolicy(Protocol):
    def open(self, *, endpoint: str, request_id: str) -> RequestWatch: ...


class Unwatched:
    """The policy of a gateway built without one (tests): no guardrails, no audit, no profiles."""

    def open(self, *, endpoint: str, request_id: str) -> RequestWatch:
        return self

    def authenticated(self, principal: Principal) -> None:
        pass

    async def admit(self, generation: GenerationRequest, *, client_id: str) -> GenerationRequest:
        return generation

    def watch(self, events: AsyncIterator[GenerationEvent]) -> AsyncIterator[GenerationEvent]:
        return events

    def failed(self, error: BaseException) -> None:
        pass
