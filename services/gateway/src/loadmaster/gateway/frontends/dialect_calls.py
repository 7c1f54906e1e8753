"""One generation for a dialect's route (Ollama, Anthropic): the same plane as the OpenAI routes.

A dialect translates its body into an OpenAI chat/completions body and its events back;
everything between is here, in the order the OpenAI routes do it (frontends/openai.py):

    policy.open -> authenticate (INFER; rate limit) -> parse (the OpenAI parser) -> the
    X-Loadmaster-* headers -> images fetched and checked -> span -> guardrails admit ->
    Generations.generate (the request plane: priority, deadline, tenant, the worker's queue)
    -> guardrails screen and the audit record (policy.watch) -> the first event

`open` returns once the first event is here (or raises: errors before the first byte are
HTTP statuses in the dialect's shape); a client that leaves while its request waits for the
first event cancels it. Then `collect` (a whole reply; None when the client left, which
cancels the generation) or `stream` (the dialect's renderer over the events; an error after
the first byte is the dialect's error event; closing it, as the server does when the client
goes, cancels the generation).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from starlette.requests import Request

from loadmaster.common import tracing
from loadmaster.common.errors import InternalError, LoadmasterError
from loadmaster.gateway.auth import INFER, Authenticator, Principal
from loadmaster.gateway.chat_images import ChatImages
from loadmaster.gateway.frontends.disconnects import ClientGone, unless_client_leaves
from loadmaster.gateway.frontends.request_headers import hints_from, with_hints
from loadmaster.gateway.generation import (
    Finished,
    GenerationEvent,
    GenerationRequest,
    Generations,
    RequestPolicy,
    RequestWatch,
    TextChunk,
    Unwatched,
)
from loadmaster.gateway.generation_items import ToolCall

__all__ = [
    "Collected",
    "DialectCalls",
    "NotAGeneration",
    "Opened",
]

log = logging.getLogger(__name__)


class NotAGeneration(Exception):  # noqa: N818 - a signal, not a failure
    """`parse` found a body that asks for no generation (Ollama's load / unload): the route
    answers it itself; nothing is queued or recorded."""


@dataclass(frozen=True, slots=True)
class Collected:
    """A whole reply: its text, the tool calls it made, and how it ended."""

    text: str
    tool_calls: tuple[ToolCall, ...]
    finished: Finished


@dataclass(slots=True)
class Opened:
    """A generation whose first event is here."""

    generation: GenerationRequest
    request_id: str
    first: GenerationEvent
    events: AsyncIterator[GenerationEvent]
    span: trace.Span
    watch: RequestWatch


async def _close(events: AsyncIterator[Any]) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()


def _edge_code(error: BaseException) -> str:
    return error.edge_code if isinstance(error, LoadmasterError) else "internal"


class DialectCalls:
    def __init__(
        self,
        generations: Generations,
        auth: Authenticator,
        policy: RequestPolicy | None = None,
        *,
        images: ChatImages | None = None,
        client_type: str,
    ) -> None:
        self._generations = generations
        self._auth = auth
        self._policy: RequestPolicy = policy or Unwatched()
        self._images = images
        self._client_type = client_type

    async def authenticate(self, token: str | None) -> Principal:
        return await self._auth.authenticate(token, INFER)

    async def open(
        self,
        request: Request,
        *,
        endpoint: str,
        request_id: str,
        token: str | None,
        parse: Callable[[], Awaitable[GenerationRequest]],
    ) -> Opened:
        """Authenticate, then parse (`parse` reads the body: an unauthenticated client's body is
        never read), queue, and wait for the first event; every failure is recorded by the
        policy and raised."""
        watch = self._policy.open(endpoint=endpoint, request_id=request_id)
        try:
            principal = await self.authenticate(token)
            watch.authenticated(principal)
            generation = with_hints(await parse(), hints_from(request.headers))
            if self._images is not None:
                generation = await self._images.resolve(generation)
        except NotAGeneration:
            raise
        except Exception as error:
            watch.failed(error)
            raise
        span = tracing.start_request_span(
            f"gateway.{self._client_type}",
            request_id=request_id,
            model_id=generation.model,
            carrier=request.headers,
            kind=trace.SpanKind.SERVER,
        )
        try:
            with trace.use_span(span, end_on_exit=False):
                client_id = generation.client_id or generation.user or principal.name or self._client_type
                generation = await watch.admit(generation, client_id=client_id)  # a profile's defaults
                events = watch.watch(
                    self._generations.generate(generation, request_id=request_id, client_id=client_id)
                )
            first = await self._first(request, events)
        except Exception as error:
            watch.failed(error)
            tracing.end_span(
                span, error_code="cancelled" if isinstance(error, ClientGone) else _edge_code(error)
            )
            raise
        return Opened(generation, request_id, first, events, span, watch)

    @staticmethod
    async def _first(request: Request, events: AsyncIterator[GenerationEvent]) -> GenerationEvent:
        try:
            return await unless_client_leaves(request, anext(events))
        except BaseException:  # ClientGone too: the client left while the request waited
            await _close(events)
            raise

    async def collect(self, request: Request, opened: Opened) -> Collected:
        """The whole reply; `ClientGone` (the generation cancelled) when the client leaves first."""
        try:  # ClientGone: closing the iterator cancelled the generation
            result = await unless_client_leaves(request, _collect(opened.first, opened.events))
        except BaseException as error:
            tracing.end_span(
                opened.span, error_code="cancelled" if isinstance(error, ClientGone) else _edge_code(error)
            )
            raise
        tracing.end_span(opened.span)
        return result

    async def stream(
        self,
        opened: Opened,
        render: Callable[[AsyncIterator[GenerationEvent]], AsyncIterator[bytes]],
        render_error: Callable[[LoadmasterError], bytes],
    ) -> AsyncIterator[bytes]:
        """The response body: `render` over every event (the first included); a failure after
        the first byte becomes `render_error`'s event and ends the body."""
        try:
            async for piece in render(_chained(opened.first, opened.events)):
                yield piece
        except Exception as error:
            if not isinstance(error, LoadmasterError):
                log.error(
                    "a generation failed mid-stream",
                    exc_info=error,
                    extra={"request_id": opened.request_id, "model": opened.generation.model},
                )
                error = InternalError(f"internal error: {type(error).__name__}")
            yield render_error(error)
        finally:
            await _close(opened.events)
            tracing.end_span(opened.span)


async def _chained(
    first: GenerationEvent, events: AsyncIterator[GenerationEvent]
) -> AsyncIterator[GenerationEvent]:
    """`first`, then the rest up to and including the one `Finished`."""
    item: GenerationEvent | None = first
    while item is not None:
        yield item
        if isinstance(item, Finished):
            return
        item = await anext(events, None)
    raise InternalError("the generation ended without a final result")


async def _collect(first: GenerationEvent, events: AsyncIterator[GenerationEvent]) -> Collected:
    parts: list[str] = []
    calls: list[ToolCall] = []
    try:
        async for item in _chained(first, events):
            if isinstance(item, Finished):
                return Collected("".join(parts), tuple(calls), item)
            if isinstance(item, TextChunk):
                parts.append(item.text)
                calls.extend(item.tool_calls)
    finally:
        await _close(events)
    raise InternalError("the generation ended without a final result")
