"""The OpenAI-compatible API's wire shapes: request bodies, replies, stream chunks, errors.

Translation only, no I/O: a request body becomes a `GenerationRequest` (or an `OpenAIError`
naming the field at fault), and a generation's pieces become the JSON objects and server-sent
events the official `openai` client reads. Shapes follow the OpenAI API reference:

- unknown body fields are ignored, as OpenAI's own server does; Loadmaster's extensions are
  `x_client_id`, `x_priority` (0 = highest, as on the edge), `x_urgency` (0..1) and
  `x_deadline_ms`, and never reach an engine;
- errors are `{"error": {"message", "type", "param", "code"}}` with the status in `OpenAIError`;
- a stream is `data: {chunk}` events, then `data: [DONE]`; a stream that fails after it began
  ends with `data: {"error": {...}}`, which the `openai` client raises as an `APIError`.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from loadmaster.common.errors import LoadmasterError

__all__ = [
    "DONE_EVENT",
    "ChatCompletionBody",
    "ChatMessage",
    "CompletionBody",
    "GenerationRequest",
    "OpenAIError",
    "Usage",
    "chat_chunk",
    "chat_completion",
    "completion",
    "completion_chunk",
    "error_body",
    "error_from",
    "event",
    "model_card",
    "parse_chat",
    "parse_completion",
]

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
DONE_EVENT = b"data: [DONE]\n\n"

# OpenAI error `type` per HTTP status (the `openai` client maps the status to its exception
# class; the type is for people and log pipelines).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


_NAMED_FIELD = re.compile(r"([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*): ")


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: HTTP `status`, and the `param` and `code` fields."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_from(error: LoadmasterError) -> OpenAIError:
    """The OpenAI form of a Loadmaster error: its HTTP status, its edge code as `code`, and
    for a 400 whose message starts with the request field it names (`max_tokens: ...`,
    `response_format.json_schema.schema: ...`, as the workers write them), that field as
    `param`."""
    named = _NAMED_FIELD.match(error.message) if error.http_status == 400 else None
    return OpenAIError(
        error.http_status, error.message, param=named.group(1) if named else None, code=error.edge_code or None
    )


# --- request bodies ------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingBody(_Body):
    """The fields chat and text completions share."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    # Loadmaster's extensions (stripped before the engine).
    x_client_id: str | None = Field(default=None, max_length=256)
    x_priority: int | None = Field(default=None, ge=0, le=255)
    x_urgency: float | None = Field(default=None, ge=0.0, le=1.0)
    x_deadline_ms: float | None = Field(default=None, gt=0.0)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list):
            if len(value) > MAX_STOP_SEQUENCES:
                raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
            if any(not s for s in value):
                raise ValueError("stop sequences must not be empty")
        return value

    @field_validator("n")
    @classmethod
    def _n(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """`text`, `json_object`, or `json_schema` with `json_schema.schema` (an object or a
        boolean): the worker compiles the schema and refuses one it cannot enforce."""
        if value is None:
            return None
        kind = value.get("type")
        if kind not in RESPONSE_FORMATS:
            raise ValueError(f"type {kind!r} is not one of {', '.join(RESPONSE_FORMATS)}")
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict):
                raise ValueError("json_schema: an object with 'name' and 'schema' is required")
            if not isinstance(spec.get("schema"), dict | bool):
                raise ValueError("json_schema.schema: a JSON Schema (an object) is required")
        return value


class ChatCompletionBody(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionBody(_SamplingBody):
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("exactly one prompt is supported")
        return value


# --- the domain request --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation as the dispatcher sees it: either chat `messages` or a text `prompt`."""

    model: str
    messages: tuple[tuple[str, str], ...] | None
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


def _invalid(error: ValidationError) -> OpenAIError:
    first = error.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    if first["type"] == "missing":
        message = f"'{param}' is a required property"
    elif first["type"] == "too_short" and param == "messages":
        message = "'messages' must contain at least one message"
    else:
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
    return OpenAIError(400, message.replace("Value error, ", ""), param=param)


def _load(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise OpenAIError(400, f"the body is not valid JSON: {error}") from None


def _request(body: _SamplingBody, **content: Any) -> GenerationRequest:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return GenerationRequest(
        model=body.model,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=stop,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        response_format=body.response_format,
        client_id=body.x_client_id,
        priority=body.x_priority,
        urgency=body.x_urgency,
        deadline_ms=body.x_deadline_ms,
        user=body.user,
        **content,
    )


def parse_chat(raw: bytes) -> GenerationRequest:
    """A `/v1/chat/completions` body, or `OpenAIError` 400 naming the field."""
    try:
        body = ChatCompletionBody.model_validate(_load(raw))
    except ValidationError as error:
        raise _invalid(error) from None
    messages = tuple((m.role, m.text()) for m in body.messages)
    return _request(body, messages=messages, prompt=None)


def parse_completion(raw: bytes) -> GenerationRequest:
    """A `/v1/completions` body, or `OpenAIError` 400 naming the field."""
    try:
        body = CompletionBody.model_validate(_load(raw))
    except ValidationError as error:
        raise _invalid(error) from None
    prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    return _request(body, messages=None, prompt=prompt)


# --- replies ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def as_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def chat_completion(
    *, request_id: str, model: str, text: str, finish_reason: str, usage: Usage, created: int | None = None
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage.as_dict(),
    }


def chat_chunk(
    *,
    request_id: str,
    model: str,
    created: int,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    usage: Usage | None = None,
) -> dict[str, Any]:
    """One `chat.completion.chunk`: a delta of text (the first carries the role), or the final
    `finish_reason`; with `usage` and no text, the usage chunk (`choices` empty)."""
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
    }
    if usage is not None and text is None and finish_reason is None:
        chunk["usage"] = usage.as_dict()
        return chunk
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if text is not None:
        delta["content"] = text
    chunk["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    return chunk


def completion(
    *, request_id: str, model: str, text: str, finish_reason: str, usage: Usage, created: int | None = None
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage.as_dict(),
    }


def completion_chunk(
    *,
    request_id: str,
    model: str,
    created: int,
    text: str = "",
    finish_reason: str | None = None,
    usage: Usage | None = None,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
    }
    if usage is not None and not text and finish_reason is None:
        chunk["choices"] = []
        chunk["usage"] = usage.as_dict()
        return chunk
    chunk["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
    return chunk


def model_card(model_id: str, *, state: str, created: int = 0) -> dict[str, Any]:
    """A `/v1/models` entry; `x_state` is the model's slot state in the fleet (READY, IDLE …)."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": "loadmaster", "x_state": state}


def event(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), allow_nan=False).encode() + b"\n\n"
