"""The OpenAI-compatible API on the gateway's HTTP port: translation only.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/responses`
(openai_responses.py), `GET /v1/models`, `GET /v1/models/{model}`. A body becomes a `GenerationRequest` (openai_schema), which the
`Generations` port runs: it yields text chunks and then exactly one `Finished`, or raises a
`LoadmasterError`. Errors before the first chunk are HTTP statuses in OpenAI's error shape
(400 naming the field, 401, 403, 404 for an unknown model, 429, 503, 504 for a request still
queued when its deadline passed); an error after a stream began is a final `error` event.

A client that disconnects cancels its generation: the chunk iterator is closed, and the
port frees the sequence. The existing API keys (or OIDC tokens), scopes and rate limits
apply (`infer` scope). A `RequestPolicy` watches each completion request: its guardrails
may refuse it or stop its completion (finish_reason `content_filter`), and it writes the
audit record (loadmaster.gateway.request_policy).

Each completion request has a span, `gateway.openai`, parented on the caller's W3C
`traceparent` header when it sent one; it is current while the generation starts (the port's
spans are its children) and ends with the response, or with the last event of a stream.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from loadmaster.common import tracing
from loadmaster.common.errors import InternalError, LoadmasterError
from loadmaster.gateway.auth import INFER, Authenticator, Principal, bearer_token
from loadmaster.gateway.chat_images import ChatImages
from loadmaster.gateway.frontends.disconnects import ClientGone, unless_client_leaves
from loadmaster.gateway.frontends.openai_common import api_route, read_body
from loadmaster.gateway.frontends.openai_responses import (
    ResponseBuilder,
    complete_response,
    parse_responses,
    response_events,
)
from loadmaster.gateway.frontends.openai_schema import (
    DEFAULT_MAX_N,
    DONE_EVENT,
    ChoiceOut,
    OpenAIError,
    Usage,
    chat_chunk,
    chat_completion,
    completion,
    completion_chunk,
    error_from,
    event,
    model_card,
    parse_chat,
    parse_completion,
)
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
    Waiting,
)
from loadmaster.gateway.generation_items import TokenLogprob, ToolCall

__all__ = [
    "CollectedChoice",
    "choices_of",
    "collect_events",
    "openai_routes",
]

log = logging.getLogger(__name__)


def openai_routes(
    generations: Generations,
    auth: Authenticator,
    *,
    gateway_id: str,
    clock: Callable[[], float] = time.time,
    policy: RequestPolicy | None = None,
    max_n: int = DEFAULT_MAX_N,
    images: ChatImages | None = None,
) -> list[Route]:
    ids = (f"{gateway_id}-{n}" for n in itertools.count(1))
    policy = policy or Unwatched()

    prefixes = {"chat": "chatcmpl-", "completion": "cmpl-", "responses": "resp_"}
    endpoints = {"chat": "chat.completions", "completion": "completions", "responses": "responses"}

    async def run(
        request: Request, parse: Callable[[bytes], tuple[GenerationRequest, Any]], *, kind: str
    ) -> Response:
        request_id = prefixes[kind] + next(ids)
        watch = policy.open(endpoint=endpoints[kind], request_id=request_id)
        try:
            principal = await auth.authenticate(bearer_token(request.headers.get("authorization")), INFER)
            watch.authenticated(principal)
            generation, context = parse(await read_body(request))
            generation = with_hints(generation, hints_from(request.headers))
            if images is not None:
                generation = await images.resolve(generation)
        except Exception as error:
            watch.failed(error)
            raise
        span = tracing.start_request_span(
            "gateway.openai",
            request_id=request_id,
            model_id=generation.model,
            carrier=request.headers,
            kind=trace.SpanKind.SERVER,
        )
        try:
            with trace.use_span(span, end_on_exit=False):
                response = await respond(
                    request, generation, context, request_id, principal, watch, kind=kind
                )
        except Exception as error:
            watch.failed(error)
            tracing.end_span(span, error_code=_edge_code(error))
            raise
        if isinstance(response, StreamingResponse):
            response.body_iterator = _ending(span, response.body_iterator)
        else:
            tracing.end_span(span, error_code="cancelled" if response.status_code == 499 else "")
        return response

    async def respond(
        request: Request,
        generation: GenerationRequest,
        context: Any,
        request_id: str,
        principal: Principal,
        watch: RequestWatch,
        *,
        kind: str,
    ) -> Response:
        client_id = generation.client_id or generation.user or principal.name or "openai"
        generation = await watch.admit(generation, client_id=client_id)
        if not generation.model:  # neither the request nor the client's profile names one
            raise OpenAIError(400, "'model' is a required property", param="model")
        tenant = principal.tenant or generation.user or generation.client_id or client_id
        events = watch.watch(
            generations.generate(generation, request_id=request_id, client_id=client_id, tenant=tenant)
        )
        created = int(clock())
        if generation.stream:
            # Errors before the first event are HTTP statuses; a stream that waits starts at
            # once, with comment lines that say where it stands (the client ignores them). The
            # Responses API's events have no place for them: its stream waits for the text.
            if kind == "responses":
                events = _without_waiting(events)
            first = await anext(events)
            model = ("" if isinstance(first, Waiting) else first.model) or generation.model
            body: AsyncIterator[bytes]
            if kind == "responses":
                builder = ResponseBuilder(request_id, context.body, created, model)
                body = _closing(response_events(events, first, builder, finished_type=Finished), events)
            else:
                body = _stream(
                    events, first, generation, request_id=request_id, created=created, chat=kind == "chat"
                )
            return StreamingResponse(
                body,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Loadmaster-Model": model},
            )
        try:
            collected, finished = await unless_client_leaves(request, collect_events(events))
        except ClientGone:  # closing the iterator cancelled the generation
            return Response(status_code=499)
        usage = Usage(finished.prompt_tokens, finished.completion_tokens)
        model = finished.model or generation.model
        if kind == "responses":
            got = collected.get(0, CollectedChoice())
            builder = ResponseBuilder(request_id, context.body, created, model)
            reply = complete_response(builder, "".join(got.text), got.tool_calls, finished)
            return JSONResponse(reply, headers={"X-Loadmaster-Model": model})
        build = chat_completion if kind == "chat" else completion
        reply = build(
            request_id=request_id,
            model=model,
            usage=usage,
            created=created,
            choices=choices_of(collected, finished, generation),
        )
        return JSONResponse(reply, headers={"X-Loadmaster-Model": model})

    def plain(parse: Callable[..., GenerationRequest]) -> Callable[[bytes], tuple[GenerationRequest, Any]]:
        return lambda raw: (parse(raw, max_n=max_n), None)

    def responses_parse(raw: bytes) -> tuple[GenerationRequest, Any]:
        parsed = parse_responses(raw)
        return parsed.generation, parsed

    async def chat_completions(request: Request) -> Response:
        return await run(request, plain(parse_chat), kind="chat")

    async def completions(request: Request) -> Response:
        return await run(request, plain(parse_completion), kind="completion")

    async def responses(request: Request) -> Response:
        return await run(request, responses_parse, kind="responses")

    async def list_models(request: Request) -> Response:
        await auth.authenticate(bearer_token(request.headers.get("authorization")), INFER)
        served = await generations.models()
        return JSONResponse(
            {"object": "list", "data": [model_card(m, state=s) for m, s in sorted(served.items())]}
        )

    async def get_model(request: Request) -> Response:
        await auth.authenticate(bearer_token(request.headers.get("authorization")), INFER)
        model_id = request.path_params["model"]
        state = (await generations.models()).get(model_id)
        if state is None:
            raise OpenAIError(
                404, f"The model '{model_id}' does not exist", param="model", code="model_not_found"
            )
        return JSONResponse(model_card(model_id, state=state))

    return [
        api_route("/v1/chat/completions", chat_completions, ["POST"]),
        api_route("/v1/completions", completions, ["POST"]),
        api_route("/v1/responses", responses, ["POST"]),
        api_route("/v1/models", list_models, ["GET"]),
        api_route("/v1/models/{model:path}", get_model, ["GET"]),
    ]


@dataclass(slots=True)
class CollectedChoice:
    """One choice's pieces, gathered from its chunks."""

    text: list[str] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, chunk: TextChunk) -> None:
        self.text.append(chunk.text)
        self.tool_calls.extend(chunk.tool_calls)
        self.logprobs.extend(chunk.logprobs)


async def collect_events(
    events: AsyncIterator[GenerationEvent],
) -> tuple[dict[int, CollectedChoice], Finished]:
    """Every chunk of a generation, by choice, and its end (the iterator is closed after)."""
    choices: dict[int, CollectedChoice] = {}
    try:
        async for item in events:
            if isinstance(item, Finished):
                return choices, item
            if isinstance(item, TextChunk):  # (a `Waiting` says nothing to a collected reply)
                choices.setdefault(item.choice, CollectedChoice()).add(item)
    finally:
        await _close(events)
    raise InternalError("the generation ended without a final result")


def choices_of(
    collected: dict[int, CollectedChoice], finished: Finished, generation: GenerationRequest
) -> list[ChoiceOut]:
    """The reply's choices: each one's text, calls, log probabilities (when asked) and end."""
    out = []
    for end in finished.choice_ends(generation.n):
        got = collected.get(end.index, CollectedChoice())
        out.append(
            ChoiceOut(
                end.index,
                "".join(got.text),
                end.finish_reason,
                tool_calls=got.tool_calls,
                logprobs=got.logprobs if generation.logprobs is not None else None,
            )
        )
    return out


def _edge_code(error: BaseException) -> str:
    return error.edge_code if isinstance(error, LoadmasterError) else "internal"


async def _ending(span: trace.Span, body: AsyncIterable[Any]) -> AsyncIterator[Any]:
    """`body`, then the request's span ends (a stream's errors are events in it)."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        tracing.end_span(span)


async def _closing(
    body: AsyncIterator[bytes], events: AsyncIterator[GenerationEvent]
) -> AsyncIterator[bytes]:
    """`body`, then `events` closed (a stream the client left cancels its generation)."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        await _close(events)


async def _without_waiting(events: AsyncIterator[GenerationEvent]) -> AsyncIterator[GenerationEvent]:
    try:
        async for item in events:
            if not isinstance(item, Waiting):
                yield item
    finally:
        await _close(events)


async def _close(events: AsyncIterator[GenerationEvent]) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()


async def _stream(
    events: AsyncIterator[GenerationEvent],
    first: GenerationEvent,
    generation: GenerationRequest,
    *,
    request_id: str,
    created: int,
    chat: bool,
) -> AsyncIterator[bytes]:
    """The SSE body: a chunk per delta of a choice (text, tool calls, log probabilities), each
    choice's finish chunk, the usage chunk when asked for, then `[DONE]`; an error after the
    first byte is an `error` event and the stream ends."""
    model = generation.model
    offsets: dict[int, int] = {}  # text completions' logprobs: where each choice's text is

    def delta_event(chunk: TextChunk) -> bytes:
        logprobs = chunk.logprobs if generation.logprobs is not None else None
        if chat:
            return event(
                chat_chunk(
                    request_id=request_id,
                    model=model,
                    created=created,
                    text=chunk.text if chunk.text or not chunk.tool_calls else None,
                    index=chunk.choice,
                    tool_calls=chunk.tool_calls,
                    logprobs=logprobs,
                )
            )
        offset = offsets.get(chunk.choice, 0)
        offsets[chunk.choice] = offset + len(chunk.text)
        return event(
            completion_chunk(
                request_id=request_id,
                model=model,
                created=created,
                text=chunk.text,
                index=chunk.choice,
                logprobs=logprobs,
                offset=offset,
            )
        )

    try:
        item: GenerationEvent | None = first
        while isinstance(item, Waiting):
            yield item.comment()
            item = await anext(events, None)
        if item is None:
            raise InternalError("the generation ended without a final result")
        model = item.model or model  # an alias's stream is the chosen model's from the start
        if chat:
            for index in range(generation.n):
                yield event(
                    chat_chunk(
                        request_id=request_id, model=model, created=created, text="", role=True, index=index
                    )
                )
        while item is not None:
            if isinstance(item, Waiting):  # not after the stream began; nothing to show
                item = await anext(events, None)
                continue
            if isinstance(item, Finished):
                model = item.model or model
                build: Any = chat_chunk if chat else completion_chunk
                for end in item.choice_ends(generation.n):
                    yield event(
                        build(
                            request_id=request_id,
                            model=model,
                            created=created,
                            finish_reason=end.finish_reason,
                            index=end.index,
                        )
                    )
                if generation.include_usage:
                    usage = Usage(item.prompt_tokens, item.completion_tokens)
                    yield event(build(request_id=request_id, model=model, created=created, usage=usage))
                yield DONE_EVENT
                return
            if item.text or item.tool_calls or (item.logprobs and generation.logprobs is not None):
                yield delta_event(item)
            item = await anext(events, None)
        raise InternalError("the generation ended without a final result")
    except Exception as error:
        if not isinstance(error, LoadmasterError):
            log.error(
                "a generation failed mid-stream",
                exc_info=error,
                extra={"request_id": request_id, "model": generation.model},
            )
            error = InternalError(f"internal error: {type(error).__name__}")
        yield event(error_from(error).body())
    finally:
        await _close(events)
