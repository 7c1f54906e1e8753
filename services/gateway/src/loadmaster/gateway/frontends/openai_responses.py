"""The Responses API's shapes (`POST /v1/responses`): translation only, no I/O.

A body becomes the same `GenerationRequest` a chat completion does (it is translated into a
chat body and parsed by `chat_request`, so both share every check):

- `input`: a string (one user message), or items: messages (`role` user / assistant /
  system / developer, `content` a string or `input_text` / `output_text` parts),
  `function_call` items (an assistant turn's calls) and `function_call_output` items (a
  `tool` turn answering `call_id`); `instructions` is a system message before them;
- `tools` (function tools, Responses' flat shape), `tool_choice`, `parallel_tool_calls`,
  `max_output_tokens`, `temperature`, `top_p`, `text.format` (text, json_object,
  json_schema: structured output), `user`, and Loadmaster's `x_*` extensions.

Stateless, as `store: false`: nothing is kept, so `previous_response_id` (and `store: true`,
`background`, `conversation`) is a 400 saying so. What this server cannot honour is a 400
naming it: `reasoning`, non-function tools, `include` entries, `truncation: auto`, items of
other types, image or file parts.

The reply is a `response` object: `output` holds a `message` item with the text (when there
is any) and one `function_call` item per call; `status` is `completed`, or `incomplete`
with `incomplete_details.reason: max_output_tokens` when the limit cut it. A stream is
server-sent events in OpenAI's order, each with its `type` and a `sequence_number`:

    response.created, response.in_progress,
    per message:  output_item.added, content_part.added, output_text.delta ...,
                  output_text.done, content_part.done, output_item.done
    per call:     output_item.added, function_call_arguments.delta,
                  function_call_arguments.done, output_item.done
    response.completed | response.incomplete       (or `error` then response.failed)
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, ValidationError

from loadmaster.common.errors import InternalError, LoadmasterError
from loadmaster.gateway.frontends.openai_schema import (
    DEFAULT_MAX_N,
    OpenAIBody,
    OpenAIError,
    chat_request,
    error_from,
    invalid,
    load_json,
)
from loadmaster.gateway.generation import MAX_MESSAGES, GenerationRequest
from loadmaster.gateway.generation_items import ToolCall

__all__ = ["ResponseBuilder", "ResponsesBody", "parse_responses", "response_events"]

# Fields of the Responses API this server does not honour, and their neutral values.
_UNHONOURED: dict[str, tuple[Any, ...]] = {
    "store": (None, False),
    "background": (None, False),
    "conversation": (None,),
    "reasoning": (None,),
    "include": (None, []),
    "truncation": (None, "disabled"),
    "prompt": (None,),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
}


class ResponsesBody(OpenAIBody):
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] = Field(max_length=MAX_MESSAGES)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    background: bool | None = None
    conversation: Any = None
    reasoning: Any = None
    include: list[str] | None = None
    truncation: str | None = None
    prompt: Any = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    x_client_id: str | None = None
    x_priority: int | None = None
    x_urgency: float | None = None
    x_deadline_ms: float | None = None


@dataclass(frozen=True, slots=True)
class ParsedResponses:
    """A Responses body: the generation, and what the reply repeats back."""

    generation: GenerationRequest
    body: ResponsesBody


def _refuse(body: ResponsesBody) -> None:
    if body.previous_response_id is not None:
        raise OpenAIError(
            400,
            "previous_response_id: responses are not kept by this server (it is stateless, as "
            "store: false); send the conversation's items in `input` instead",
            param="previous_response_id",
        )
    for name, neutral in _UNHONOURED.items():
        value = getattr(body, name)
        if not any(value == ok and type(value) is type(ok) for ok in neutral) and value is not None:
            why = (
                "responses are not kept by this server"
                if name in ("store", "background", "conversation")
                else ("not supported by this server")
            )
            raise OpenAIError(
                400, f"{name}: {json.dumps(value)[:80]}: {why}", param=name, code="unsupported_parameter"
            )


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(400, f"{where}: a string or a list of text parts", param=where)
    parts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise OpenAIError(
                400, f"{where}[{index}]: {kind!r} parts are not supported (text parts only)", param=where
            )
        parts.append(part["text"])
    return "".join(parts)


def _messages(body: ResponsesBody) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages (tool calls and their outputs included)."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return messages
    names: dict[str, str] = {}
    for index, item in enumerate(body.input):
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise OpenAIError(
                    400, f"{where}.role: {role!r} is not user, assistant, system or developer", param=where
                )
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "")
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, str):
                raise OpenAIError(
                    400, f"{where}: a function_call needs call_id, name and arguments (text)", param=where
                )
            names[call_id] = name
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise OpenAIError(400, f"{where}.call_id: required", param=where)
            text = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            message = {"role": "tool", "tool_call_id": call_id, "content": text}
            if call_id in names:
                message["name"] = names[call_id]
            messages.append(message)
        else:
            raise OpenAIError(
                400, f"{where}.type: {kind!r} items are not supported by this server", param=where
            )
    if not messages:
        raise OpenAIError(400, "input: at least one item is required", param="input")
    return messages


def _tools(body: ResponsesBody) -> list[dict[str, Any]] | None:
    if body.tools is None:
        return None
    out = []
    for index, tool in enumerate(body.tools):
        if tool.get("type") != "function":
            raise OpenAIError(
                400,
                f"tools[{index}].type: {tool.get('type')!r} tools are not supported by this server (function tools only)",
                param=f"tools[{index}].type",
            )
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(body: ResponsesBody) -> Any:
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise OpenAIError(
                400, "tool_choice: auto, none, required or {type: function, name}", param="tool_choice"
            )
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(body: ResponsesBody) -> dict[str, Any] | None:
    spec = (body.text or {}).get("format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "json_schema":
        return {
            "type": "json_schema",
            "json_schema": {"name": spec.get("name", ""), "schema": spec.get("schema")},
        }
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise OpenAIError(
        400, f"text.format.type: {kind!r} is not text, json_object or json_schema", param="text.format"
    )


def parse_responses(raw: bytes) -> ParsedResponses:
    """A `/v1/responses` body, or `OpenAIError` 400 naming the field."""
    try:
        body = ResponsesBody.model_validate(load_json(raw))
    except ValidationError as error:
        raise invalid(error) from None
    _refuse(body)
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": _messages(body),
        "stream": body.stream,
    }
    optional = {
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": _tools(body),
        "tool_choice": _tool_choice(body),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body),
        "user": body.user,
        "service_tier": body.service_tier,
        "x_client_id": body.x_client_id,
        "x_priority": body.x_priority,
        "x_urgency": body.x_urgency,
        "x_deadline_ms": body.x_deadline_ms,
    }
    chat.update({key: value for key, value in optional.items() if value is not None})
    return ParsedResponses(chat_request(chat, max_n=DEFAULT_MAX_N), body)


# ---- replies ----------------------------------------------------------------------------


@dataclass(slots=True)
class ResponseBuilder:
    """One response's state: its output items as they grow, and the object that carries them."""

    response_id: str
    body: ResponsesBody
    created_at: int
    model: str
    output: list[dict[str, Any]] = field(default_factory=list)
    status: str = "in_progress"
    usage: dict[str, Any] | None = None
    incomplete: str | None = None
    _items: int = 0

    def item_id(self, prefix: str) -> str:
        self._items += 1
        return f"{prefix}_{self.response_id.removeprefix('resp_')}_{self._items}"

    def message(self, text: str, *, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
        return {
            "type": "message",
            "id": item_id or self.item_id("msg"),
            "status": status,
            "role": "assistant",
            "content": [] if status == "in_progress" else [_output_text(text)],
        }

    def call(
        self, call: ToolCall, *, arguments: str | None = None, item_id: str | None = None
    ) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": item_id or self.item_id("fc"),
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments if arguments is None else arguments,
            "status": "completed" if arguments is None else "in_progress",
        }

    def finish(self, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        if finish_reason == "length":
            self.status, self.incomplete = "incomplete", "max_output_tokens"
        else:
            self.status = "completed"
        self.usage = {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def object(self) -> dict[str, Any]:
        body = self.body
        tools = [
            {
                "type": "function",
                "name": t.get("name", ""),
                "description": t.get("description"),
                "parameters": t.get("parameters"),
                "strict": t.get("strict"),
            }
            for t in body.tools or ()
        ]
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "error": None,
            "incomplete_details": {"reason": self.incomplete} if self.incomplete else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": list(self.output),
            "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
            "previous_response_id": None,
            "store": False,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": body.tool_choice or "auto",
            "tools": tools,
            "text": body.text or {"format": {"type": "text"}},
            "truncation": "disabled",
            "metadata": body.metadata or {},
            "user": body.user,
            "usage": self.usage,
        }


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def sse(kind: str, payload: dict[str, Any]) -> bytes:
    """One server-sent event with its `event:` name, as OpenAI writes the Responses stream."""
    data = json.dumps({"type": kind, **payload}, separators=(",", ":"), allow_nan=False)
    return f"event: {kind}\ndata: {data}\n\n".encode()


class _Events:
    """Numbers the stream's events (`sequence_number`) as they are written."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, kind: str, **payload: Any) -> bytes:
        event = sse(kind, {**payload, "sequence_number": self.count})
        self.count += 1
        return event


async def response_events(
    events: AsyncIterator[Any],
    first: Any,
    builder: ResponseBuilder,
    *,
    finished_type: type,
    on_error: Callable[[BaseException], None] | None = None,
) -> AsyncIterator[bytes]:
    """The Responses stream of one generation (module docstring); `first` is its first event,
    already read (errors before it were HTTP statuses)."""
    emit = _Events()
    message: dict[str, Any] | None = None  # the open message item
    text: list[str] = []

    def close_message() -> list[bytes]:
        nonlocal message
        if message is None:
            return []
        done = "".join(text)
        index = len(builder.output)
        item = builder.message(done, item_id=message["id"])
        builder.output.append(item)
        part = _output_text(done)
        out = [
            emit(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=done,
                logprobs=[],
            ),
            emit(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            ),
            emit("response.output_item.done", output_index=index, item=item),
        ]
        message = None
        text.clear()
        return out

    try:
        yield emit("response.created", response=builder.object())
        yield emit("response.in_progress", response=builder.object())
        item: Any = first
        while item is not None:
            if isinstance(item, finished_type):
                for event in close_message():
                    yield event
                end: Any = item
                builder.finish(end.finish_reason, end.prompt_tokens, end.completion_tokens)
                done = "response.incomplete" if builder.status == "incomplete" else "response.completed"
                yield emit(done, response=builder.object())
                return
            if item.text:
                index = len(builder.output)
                if message is None:
                    message = builder.message("", status="in_progress")
                    yield emit("response.output_item.added", output_index=index, item=message)
                    yield emit(
                        "response.content_part.added",
                        item_id=message["id"],
                        output_index=index,
                        content_index=0,
                        part=_output_text(""),
                    )
                text.append(item.text)
                yield emit(
                    "response.output_text.delta",
                    item_id=message["id"],
                    output_index=index,
                    content_index=0,
                    delta=item.text,
                    logprobs=[],
                )
            for call in item.tool_calls:
                for event in close_message():
                    yield event
                index = len(builder.output)
                item_id = builder.item_id("fc")
                yield emit(
                    "response.output_item.added",
                    output_index=index,
                    item=builder.call(call, arguments="", item_id=item_id),
                )
                yield emit(
                    "response.function_call_arguments.delta",
                    item_id=item_id,
                    output_index=index,
                    delta=call.arguments,
                )
                yield emit(
                    "response.function_call_arguments.done",
                    item_id=item_id,
                    output_index=index,
                    arguments=call.arguments,
                )
                done_item = builder.call(call, item_id=item_id)
                builder.output.append(done_item)
                yield emit("response.output_item.done", output_index=index, item=done_item)
            item = await anext(events, None)
        raise InternalError("the generation ended without a final result")
    except Exception as error:
        if on_error is not None:
            on_error(error)
        mapped = error_from(
            error
            if isinstance(error, LoadmasterError)
            else InternalError(f"internal error: {type(error).__name__}")
        )
        yield emit("error", code=mapped.code, message=mapped.message, param=None)
        builder.status = "failed"
        failed = builder.object()
        failed["error"] = {"code": "server_error", "message": mapped.message}
        yield emit("response.failed", response=failed)


def complete_response(
    builder: ResponseBuilder, text: str, calls: list[ToolCall], finished: Any
) -> dict[str, Any]:
    """The whole `response` object of a finished generation."""
    if text:
        builder.output.append(builder.message(text))
    for call in calls:
        builder.output.append(builder.call(call))
    builder.finish(finished.finish_reason, finished.prompt_tokens, finished.completion_tokens)
    return builder.object()


def now() -> int:
    return int(time.time())
