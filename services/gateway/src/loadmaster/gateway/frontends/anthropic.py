"""Anthropic's Messages API on the gateway's HTTP port: translation only (docs/dialects.md).

Routes: `POST /v1/messages` (streaming and not), `POST /v1/messages/count_tokens`, and
`GET /v1/models[/{id}]` in Anthropic's shape when the request carries `anthropic-version`
(the `anthropic` client always does; without it the OpenAI routes answer). A Messages body
becomes an OpenAI chat/completions body and goes through the OpenAI parser and the same
request plane (frontends/dialect_calls.py); its events come back as Anthropic's.

    system (text or text blocks)       -> a system message first
    messages: text and image blocks    -> messages with text and image parts (base64 or URL)
    tool_use / tool_result blocks      -> an assistant's tool_calls / `tool` turns
    tools (custom), tool_choice        -> function tools, tool_choice (any: required; tool:
                                          that function), disable_parallel_tool_use
    max_tokens, stop_sequences, temperature, top_p, metadata.user_id  -> the OpenAI fields
    output_config.format (json_schema) -> response_format
    thinking {type: enabled|disabled}  -> chat_template_kwargs.enable_thinking

A stream is `message_start`, `ping`, then `content_block_start`, `content_block_delta`...,
`content_block_stop` per block (text, then each tool call as a whole tool_use block),
`message_delta` (stop reason and the usage, input tokens included), `message_stop`; an
error after it began is an `error` event. `stop_reason` is `end_turn`, `max_tokens`,
`tool_use`, or `refusal` (a guardrail stopped it). `count_tokens` counts the prompt
exactly as the model sees it (its chat template): it runs the prompt through the model for
one token, on the same request plane. The API key is `x-api-key` (or a bearer token).
A tool_result's `is_error` reaches the model as its text prefixed with "Error: ". Fields
this server cannot honour (top_k, prefill, documents, server tools ...) are a 400 naming
them. Errors are `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from loadmaster.common.errors import InternalError, LoadmasterError
from loadmaster.gateway.auth import bearer_token
from loadmaster.gateway.frontends.dialect_calls import Collected, DialectCalls
from loadmaster.gateway.frontends.disconnects import ClientGone
from loadmaster.gateway.frontends.openai_common import api_route, read_body
from loadmaster.gateway.frontends.openai_schema import (
    ChatCompletionBody,
    OpenAIError,
    chat_request,
    json_object,
    relevant_error,
)
from loadmaster.gateway.frontends.request_headers import retry_after
from loadmaster.gateway.generation import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    Finished,
    GenerationEvent,
    GenerationRequest,
    TextChunk,
)
from loadmaster.gateway.generation_items import ToolCall

__all__ = ["AnthropicError", "anthropic_routes", "messages_body"]

log = logging.getLogger(__name__)

VERSION_HEADER = "anthropic-version"
_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "content_filter": "refusal",
    "tool_calls": "tool_use",
}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
# Body fields Anthropic defines that these routes cannot honour: a 400 naming them.
_UNHONOURED = {
    "top_k": "top-k sampling is not supported (use top_p)",
    "container": "code-execution containers are not supported",
    "mcp_servers": "MCP servers are not supported",
    "context_management": "context management is not supported",
    "inference_geo": "inference geography is not supported",
    "diagnostics": "diagnostics are not supported",
}
_BLOCK_TYPES = ("text", "image", "tool_use", "tool_result")
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


class AnthropicError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# --- bodies ----------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class Source(_Body):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class Block(_Body):
    type: str
    text: str | None = None
    source: dict[str, Any] | None = None  # an image's (checked once the type is known)
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: Any = None  # tool_use: the call's arguments (an object)
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None  # tool_result
    is_error: bool = False  # tool_result: its content is the error the call met


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(max_length=MAX_CONTENT_PARTS)]  # a string has no part limit


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]


class Metadata(_Body):
    user_id: str | None = None


class MessagesBody(_Body):
    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    metadata: Metadata | None = None
    thinking: Thinking | None = None
    output_config: dict[str, Any] | None = None
    speed: Literal["standard"] | None = None  # "fast" is a faster model variant: none here
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


class CountTokensBody(_Body):
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[Block] | None = None
    thinking: Thinking | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


# --- translation -------------------------------------------------------------------------------


def _invalid(error: ValidationError, *, prefix: str = "") -> AnthropicError:
    where, kind, message = relevant_error(error)
    where = ".".join(part for part in (prefix, where) if part)
    if kind == "missing":
        return AnthropicError(400, f"{where}: Field required")
    return AnthropicError(400, f"{where}: {message}" if where else message)


def _text_of(blocks: str | list[Block], where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    for index, block in enumerate(blocks):
        if block.type != "text":
            raise AnthropicError(400, f"{where}.{index}.type: only text blocks are allowed here")
    return "".join(block.text or "" for block in blocks)


def _parts(blocks: list[Block], index: int) -> list[dict[str, Any]]:
    """A user message's text and image blocks as OpenAI content parts."""
    parts: list[dict[str, Any]] = []
    for n, block in enumerate(blocks):
        where = f"messages.{index}.content.{n}"
        if block.type == "text":
            parts.append({"type": "text", "text": block.text or ""})
        elif block.type == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, where)}})
    return parts


def _tool_result(block: Block, where: str, names: dict[str, str]) -> dict[str, Any]:
    """A tool_result block as a `tool` turn answering its call."""
    if not block.tool_use_id:
        raise AnthropicError(400, f"{where}.tool_use_id: Field required")
    content = block.content
    if isinstance(content, list):
        for n, part in enumerate(content):
            if part.type != "text":
                raise AnthropicError(
                    400, f"{where}.content.{n}.type: only text is supported in a tool result"
                )
        content = "".join(part.text or "" for part in content)
    text = content or ""
    return {
        "role": "tool",
        "tool_call_id": block.tool_use_id,
        "name": names.get(block.tool_use_id, ""),
        "content": f"Error: {text}" if block.is_error else text,
    }


def _turns(message: Message, index: int, names: dict[str, str]) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI messages: a user message's tool results become `tool`
    turns (first, as Anthropic orders them), an assistant's tool_use blocks its tool_calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    for n, block in enumerate(message.content):
        where = f"messages.{index}.content.{n}"
        if block.type not in _BLOCK_TYPES:
            raise AnthropicError(
                400, f"{where}.type: {block.type!r} is not supported (supported: {', '.join(_BLOCK_TYPES)})"
            )
        allowed = ("text", "tool_use") if message.role == "assistant" else ("text", "image", "tool_result")
        if block.type not in allowed:
            raise AnthropicError(
                400, f"{where}.type: {block.type!r} blocks are not accepted in {message.role} messages"
            )
    if message.role == "assistant":
        calls = []
        for n, block in enumerate(message.content):
            if block.type != "tool_use":
                continue
            where = f"messages.{index}.content.{n}"
            if not block.id or not block.name:
                raise AnthropicError(400, f"{where}: a tool_use block needs an id and a name")
            names[block.id] = block.name
            arguments = json.dumps(block.input if block.input is not None else {}, separators=(",", ":"))
            calls.append(
                {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}
            )
        turn: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(b.text or "" for b in message.content if b.type == "text"),
        }
        if calls:
            turn["tool_calls"] = calls
        return [turn]
    out = [
        _tool_result(block, f"messages.{index}.content.{n}", names)
        for n, block in enumerate(message.content)
        if block.type == "tool_result"
    ]
    parts = _parts([b for b in message.content if b.type != "tool_result"], index)
    if parts or not out:
        out.append({"role": "user", "content": parts})
    return out


def _tools(tools: list[dict[str, Any]] | None, choice: dict[str, Any] | None, out: dict[str, Any]) -> None:
    """Anthropic's `tools` and `tool_choice` as OpenAI's function tools."""
    if not tools:
        if choice is not None and choice.get("type") != "none":
            raise AnthropicError(400, "tool_choice: is only allowed when tools are given")
        return
    functions = []
    for index, tool in enumerate(tools):
        kind = tool.get("type") or "custom"
        if kind != "custom":
            raise AnthropicError(
                400, f"tools.{index}.type: {kind!r}: server tools are not supported (custom tools are)"
            )
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise AnthropicError(400, f"tools.{index}.name: Field required")
        if not isinstance(schema, dict):
            raise AnthropicError(400, f"tools.{index}.input_schema: a JSON Schema (an object) is required")
        function: dict[str, Any] = {"name": name, "parameters": schema}
        if tool.get("description"):
            function["description"] = tool["description"]
        if tool.get("strict") is not None:
            function["strict"] = bool(tool["strict"])
        functions.append({"type": "function", "function": function})
    out["tools"] = functions
    if choice is None:
        return
    kind = choice.get("type")
    if kind == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name") or ""}}
    elif kind in _TOOL_CHOICES:
        out["tool_choice"] = _TOOL_CHOICES[kind]
    else:
        raise AnthropicError(400, f"tool_choice.type: {kind!r} is not one of auto, any, tool, none")
    if choice.get("disable_parallel_tool_use") and kind != "none":
        out["parallel_tool_calls"] = False


def _image_url(block: Block, where: str) -> str:
    if block.source is None:
        raise AnthropicError(400, f"{where}.source: Field required")
    try:
        source = Source.model_validate(block.source)
    except ValidationError as error:
        raise _invalid(error, prefix=f"{where}.source") from None
    if source.type == "url":
        if not source.url:
            raise AnthropicError(400, f"{where}.source.url: Field required")
        return source.url
    if not source.data or not source.media_type:
        raise AnthropicError(400, f"{where}.source: base64 images need media_type and data")
    return f"data:{source.media_type};base64,{source.data}"


def _thinking(thinking: Thinking | None, out: dict[str, Any]) -> None:
    if thinking is None:
        return
    if thinking.type == "adaptive":
        raise AnthropicError(400, "thinking.type: 'adaptive' is not supported (enabled or disabled)")
    if "chat_template_kwargs" not in ChatCompletionBody.model_fields:
        raise AnthropicError(400, "thinking: this server has no thinking switch")
    out["chat_template_kwargs"] = {"enable_thinking": thinking.type == "enabled"}


def _messages(system: str | list[Block] | None, messages: list[Message]) -> list[dict[str, Any]]:
    if messages[-1].role == "assistant":
        raise AnthropicError(
            400,
            "messages: the last message is the assistant's (prefill), which this server does not continue",
        )
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text_of(system, "system")})
    names: dict[str, str] = {}  # tool_use id -> the function it called
    for index, message in enumerate(messages):
        out.extend(_turns(message, index, names))
    return out


def _refuse_unhonoured(raw: Mapping[str, Any]) -> None:
    for name, reason in _UNHONOURED.items():
        if raw.get(name) not in (None, [], {}):
            raise AnthropicError(400, f"{name}: {reason}")


def messages_body(raw: Mapping[str, Any], body: MessagesBody) -> dict[str, Any]:
    """A Messages body as an OpenAI chat/completions body."""
    _refuse_unhonoured(raw)
    out: dict[str, Any] = {
        "model": body.model,
        "max_tokens": body.max_tokens,
        "messages": _messages(body.system, body.messages),
        "stream": body.stream,
    }
    if body.stop_sequences:
        out["stop"] = body.stop_sequences
    if body.temperature is not None:
        out["temperature"] = body.temperature
    if body.top_p is not None:
        out["top_p"] = body.top_p
    if body.metadata is not None and body.metadata.user_id:
        out["user"] = body.metadata.user_id
    if body.output_config:
        out["response_format"] = _output_format(body.output_config)
    _tools(body.tools, body.tool_choice, out)
    _thinking(body.thinking, out)
    return out


def _output_format(config: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(config) - {"format"})
    if unknown:
        raise AnthropicError(400, f"output_config.{unknown[0]}: not supported")
    spec = config.get("format")
    if (
        not isinstance(spec, dict)
        or spec.get("type") != "json_schema"
        or not isinstance(spec.get("schema"), dict)
    ):
        raise AnthropicError(
            400, 'output_config.format: {"type": "json_schema", "schema": {...}} is required'
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": spec["schema"]}}


_FIELD_NAMES = {
    "stop": "stop_sequences",
    "response_format": "output_config.format",
    "user": "metadata.user_id",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
}


def _openai_error(error: OpenAIError) -> AnthropicError:
    message = error.message
    if error.param:
        head = error.param.split(".")[0]
        if head in _FIELD_NAMES:
            message = message.replace(error.param, _FIELD_NAMES[head] + error.param[len(head) :], 1)
        elif head == "tools":  # tools.0.function.parameters -> tools.0.input_schema
            named = error.param.replace(".function.parameters", ".input_schema").replace(".function.", ".")
            message = message.replace(error.param, named, 1)
    return AnthropicError(error.status, message)


def parse(openai_body: dict[str, Any]) -> GenerationRequest:
    try:
        return chat_request(openai_body)
    except OpenAIError as error:
        raise _openai_error(error) from None


# --- replies ---------------------------------------------------------------------------------


def _sse(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _error_event(error: LoadmasterError) -> bytes:
    return _sse("error", error_body(error.http_status, error.message))


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments_object()}


def _message(message_id: str, model: str, reply: Collected) -> dict[str, Any]:
    text, finished = reply.text, reply.finished
    content = [{"type": "text", "text": text}] if text or not reply.tool_calls else []
    content += [_tool_use(call) for call in reply.tool_calls]
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": _STOP_REASONS.get(finished.finish_reason, "end_turn"),
        "stop_sequence": None,
        "usage": {"input_tokens": finished.prompt_tokens, "output_tokens": finished.completion_tokens},
    }


class _Blocks:
    """A streamed reply's content blocks, indexed in order: a text block opens at the first
    text and stays open across chunks; each tool call is a whole tool_use block (its
    arguments in one input_json_delta: calls arrive complete)."""

    def __init__(self) -> None:
        self.count = 0
        self.text_open = False

    def text(self, text: str) -> list[bytes]:
        out = [] if self.text_open else [self._start({"type": "text", "text": ""})]
        self.text_open = True
        delta = {"type": "text_delta", "text": text}
        out.append(
            _sse(
                "content_block_delta",
                {"type": "content_block_delta", "index": self.count - 1, "delta": delta},
            )
        )
        return out

    def tool_use(self, call: ToolCall) -> list[bytes]:
        out = self._close()
        out.append(self._start({"type": "tool_use", "id": call.id, "name": call.name, "input": {}}))
        delta = {"type": "input_json_delta", "partial_json": call.arguments or "{}"}
        out.append(
            _sse(
                "content_block_delta",
                {"type": "content_block_delta", "index": self.count - 1, "delta": delta},
            )
        )
        out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": self.count - 1}))
        return out

    def finish(self) -> list[bytes]:
        if self.count == 0:  # an empty reply still has its (empty) text block, as when not streamed
            return [*self.text("")[:1], *self._close()]
        return self._close()

    def _start(self, block: dict[str, Any]) -> bytes:
        self.count += 1
        return _sse(
            "content_block_start",
            {"type": "content_block_start", "index": self.count - 1, "content_block": block},
        )

    def _close(self) -> list[bytes]:
        if not self.text_open:
            return []
        self.text_open = False
        return [_sse("content_block_stop", {"type": "content_block_stop", "index": self.count - 1})]


def _model_info(model_id: str) -> dict[str, Any]:
    return {"type": "model", "id": model_id, "display_name": model_id, "created_at": "1970-01-01T00:00:00Z"}


def anthropic_routes(
    calls: DialectCalls,
    *,
    models: Callable[[], Awaitable[dict[str, str]]],
    openai_models: Callable[[Request], Awaitable[Response]],
    openai_model: Callable[[Request], Awaitable[Response]],
    gateway_id: str,
    max_body_bytes: int,
) -> list[Route]:
    """The Messages routes; `GET /v1/models[/{id}]` without `anthropic-version` goes to
    `openai_models` / `openai_model`."""
    ids = (f"{gateway_id}-a{n}" for n in itertools.count(1))

    def token(request: Request) -> str | None:
        return request.headers.get("x-api-key") or bearer_token(request.headers.get("authorization"))

    async def create(request: Request) -> Response:
        bodies: list[MessagesBody] = []

        async def parsed() -> GenerationRequest:  # after authentication: then the body is read
            raw = json_object(await read_body(request, max_body_bytes), AnthropicError)
            try:
                body = MessagesBody.model_validate(raw)
            except ValidationError as error:
                raise _invalid(error) from None
            bodies.append(body)
            return parse(messages_body(raw, body))

        message_id = "msg_" + next(ids)
        opened = await calls.open(
            request, endpoint="anthropic.messages", request_id=message_id, token=token(request), parse=parsed
        )
        model = bodies[0].model
        if not bodies[0].stream:
            reply = await calls.collect(request, opened)
            answered = reply.finished.model or model
            return JSONResponse(
                _message(message_id, answered, reply), headers={"X-Loadmaster-Model": answered}
            )

        async def events(items: AsyncIterator[GenerationEvent]) -> AsyncIterator[bytes]:
            blocks = _Blocks()
            start: dict[str, Any] = {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "model": opened.first.model or model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0},
            }
            # Each generation event's SSE events leave in one write (the first with the
            # message's opening ones): fewer, larger writes, and the first text is not behind
            # three writes of preamble.
            pieces = [
                _sse("message_start", {"type": "message_start", "message": start}),
                _sse("ping", {"type": "ping"}),
            ]
            async for item in items:
                if isinstance(item, TextChunk):
                    if item.text:
                        pieces += blocks.text(item.text)
                    for call in item.tool_calls:
                        pieces += blocks.tool_use(call)
                elif isinstance(item, Finished):
                    pieces += blocks.finish()
                    delta = {
                        "stop_reason": _STOP_REASONS.get(item.finish_reason, "end_turn"),
                        "stop_sequence": None,
                    }
                    usage = {"input_tokens": item.prompt_tokens, "output_tokens": item.completion_tokens}
                    pieces.append(
                        _sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
                    )
                    pieces.append(_sse("message_stop", {"type": "message_stop"}))
                if pieces:
                    yield b"".join(pieces)
                    pieces = []

        return StreamingResponse(
            calls.stream(opened, events, _error_event),
            media_type="text/event-stream",
            headers={
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                "X-Loadmaster-Model": opened.first.model or model,
            },
        )

    async def count_tokens(request: Request) -> Response:
        async def parsed() -> GenerationRequest:  # after authentication: then the body is read
            raw = json_object(await read_body(request, max_body_bytes), AnthropicError)
            try:
                body = CountTokensBody.model_validate(raw)
            except ValidationError as error:
                raise _invalid(error) from None
            _refuse_unhonoured(raw)
            openai_body: dict[str, Any] = {
                "model": body.model,
                "messages": _messages(body.system, body.messages),
                "max_tokens": 1,
                "temperature": 0,
            }
            _tools(body.tools, body.tool_choice, openai_body)
            if "tool_choice" in openai_body and openai_body["tool_choice"] != "none":
                openai_body["tool_choice"] = "auto"  # counting: nothing is decoded, so nothing constrained
            _thinking(body.thinking, openai_body)
            return parse(openai_body)

        opened = await calls.open(
            request,
            endpoint="anthropic.count_tokens",
            request_id="count_" + next(ids),
            token=token(request),
            parse=parsed,
        )
        reply = await calls.collect(request, opened)
        return JSONResponse({"input_tokens": reply.finished.prompt_tokens})

    async def list_models(request: Request) -> Response:
        if VERSION_HEADER not in request.headers:
            return await openai_models(request)
        await calls.authenticate(token(request))
        names = sorted(await models())
        limit = _limit(request.query_params.get("limit"))
        after, before = request.query_params.get("after_id"), request.query_params.get("before_id")
        if after in names:
            names = names[names.index(after) + 1 :]
        if before in names:
            names = names[: names.index(before)]
        page = names[-limit:] if before and not after else names[:limit]
        return JSONResponse(
            {
                "data": [_model_info(name) for name in page],
                "has_more": len(page) < len(names),
                "first_id": page[0] if page else None,
                "last_id": page[-1] if page else None,
            }
        )

    async def get_model(request: Request) -> Response:
        if VERSION_HEADER not in request.headers:
            return await openai_model(request)
        await calls.authenticate(token(request))
        model_id = request.path_params["model"]
        if model_id not in await models():
            raise AnthropicError(404, f"model: {model_id}")
        return JSONResponse(_model_info(model_id))

    return [
        api_route("/v1/messages", create, ["POST"], _error_response),
        api_route("/v1/messages/count_tokens", count_tokens, ["POST"], _error_response),
        api_route("/v1/models", list_models, ["GET"], _error_response),
        api_route("/v1/models/{model:path}", get_model, ["GET"], _error_response),
    ]


def _limit(value: str | None) -> int:
    if value is None:
        return 20
    if not value.isdigit() or not 1 <= int(value) <= 1000:
        raise AnthropicError(400, f"limit: {value!r} is not an integer in 1..1000")
    return int(value)


def _error_response(error: Exception) -> Response:
    if isinstance(error, ClientGone):
        return Response(status_code=499)
    if isinstance(error, AnthropicError):
        return JSONResponse(error_body(error.status, error.message), status_code=error.status)
    if isinstance(error, OpenAIError):
        mapped = _openai_error(error)
        return JSONResponse(error_body(mapped.status, mapped.message), status_code=mapped.status)
    known = error if isinstance(error, LoadmasterError) else None
    if known is None:
        log.error("unhandled error in the Anthropic API", exc_info=error)
        known = InternalError(f"internal error: {type(error).__name__}")
    return JSONResponse(
        error_body(known.http_status, known.message),
        status_code=known.http_status,
        headers=retry_after(known),
    )
