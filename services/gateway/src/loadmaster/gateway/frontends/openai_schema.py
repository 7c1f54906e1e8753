"""The OpenAI-compatible API's wire shapes: request bodies, replies, stream chunks, errors.

Translation only, no I/O: a request body becomes a `GenerationRequest` (or an `OpenAIError`
naming the field at fault), and a generation's pieces become the JSON objects and server-sent
events the official `openai` client reads. Shapes follow the OpenAI API reference:

- unknown body fields are ignored, as OpenAI's own server does; a known field whose value this
  server cannot honour (`frequency_penalty` 0.5, `logit_bias`, `echo`, `store: true` ...) is a
  400 naming it, never accepted and ignored (`UNHONOURED`). Loadmaster's extensions are
  `x_client_id`, `x_priority` (0 = highest, as on the edge), `x_urgency` (0..1) and
  `x_deadline_ms`, and never reach an engine; `chat_template_kwargs` (vLLM's) on chat
  completions reaches the model's chat template;
- tools (`tools`, `tool_choice`, `parallel_tool_calls`), `logprobs` / `top_logprobs` and `n`
  (up to `gateway.max_n`) become the request's `ToolUse`, `logprobs` and `n`; replies carry
  each choice's text, `tool_calls` and `logprobs` (loadmaster.gateway.generation_items);
- errors are `{"error": {"message", "type", "param", "code"}}` with the status in `OpenAIError`;
- a stream is `data: {chunk}` events, then `data: [DONE]`; a stream that fails after it began
  ends with `data: {"error": {...}}`, which the `openai` client raises as an `APIError`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator

from loadmaster.common.errors import LoadmasterError
from loadmaster.gateway.generation import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    ChatImage,
    GenerationRequest,
    RequestError,
)
from loadmaster.gateway.generation_items import (
    LOGPROB_FLOOR,
    ChatTurn,
    FunctionSpec,
    TokenLogprob,
    ToolCall,
    ToolUse,
)

__all__ = [
    "DEFAULT_MAX_N",
    "DONE_EVENT",
    "UNHONOURED",
    "ChatCompletionBody",
    "ChatImage",
    "ChatMessage",
    "ChoiceOut",
    "CompletionBody",
    "GenerationRequest",
    "OpenAIBody",
    "OpenAIError",
    "Usage",
    "chat_chunk",
    "chat_completion",
    "chat_logprobs",
    "chat_request",
    "completion",
    "completion_chunk",
    "completion_logprobs",
    "error_body",
    "error_from",
    "event",
    "invalid",
    "json_object",
    "load_json",
    "model_card",
    "parse_chat",
    "parse_completion",
    "refuse_unhonoured",
    "relevant_error",
    "tool_call_json",
]

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_TOP_LOGPROBS = 20  # OpenAI's limit (chat); text completions take `logprobs` 0..5
MAX_COMPLETION_LOGPROBS = 5
DEFAULT_MAX_N = 8  # gateway.max_n
CONTENT_PART_TYPES = ("text", "image_url")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# Chat-template variables the server itself sets when it renders a chat.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "tools",
        "documents",
        "tokenize",
        "chat_template",
        "return_dict",
        "return_tensors",
        "bos_token",
        "eos_token",
    }
)
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


class OpenAIError(RequestError):
    """A `RequestError` answered in OpenAI's shape (`body`)."""

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
        error.http_status,
        error.message,
        param=named.group(1) if named else None,
        code=error.edge_code or None,
    )


# --- request bodies ------------------------------------------------------------------------


class OpenAIBody(BaseModel):
    """Every OpenAI request body's base: unknown fields are ignored (as OpenAI's own server
    does); the ones we cannot honour are refused by name (`refuse_unhonoured`)."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class TextPart(OpenAIBody):
    type: Literal["text"]
    text: str


class ImageUrl(OpenAIBody):
    url: str = Field(min_length=1)
    detail: Literal["auto"] | None = None  # "low" / "high" would change what the model sees: refused


class ImagePart(OpenAIBody):
    """An image (a data URL, or an http(s) URL from `gateway.image_url_allow`), fetched and
    checked by the gateway (loadmaster.gateway.chat_images) before the request is queued."""

    type: Literal["image_url"]
    image_url: ImageUrl


def _part_tag(part: Any) -> str:
    """A content part's union tag, bracketed so error locations can leave it out."""
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return f"[{kind}]"


ContentPart = Annotated[
    Annotated[TextPart, Tag("[text]")] | Annotated[ImagePart, Tag("[image_url]")], Discriminator(_part_tag)
]


class FunctionCallBody(OpenAIBody):
    name: str = Field(min_length=1)
    arguments: str = ""  # JSON text, as the model wrote it


class ToolCallBody(OpenAIBody):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallBody


class ChatMessage(OpenAIBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallBody] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value: Any) -> Any:
        """A list's parts must each be a known type (the union's own error names the string
        branch first, which says nothing about the part at fault)."""
        if isinstance(value, list):
            if len(value) > MAX_CONTENT_PARTS:
                raise ValueError(f"{len(value)} parts exceed this server's limit of {MAX_CONTENT_PARTS}")
            for index, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in CONTENT_PART_TYPES:
                    raise ValueError(
                        f"part {index}: type {kind!r} is not one of {', '.join(CONTENT_PART_TYPES)}"
                    )
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def image_urls(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]


class FunctionBody(OpenAIBody):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolBody(OpenAIBody):
    type: Literal["function"]
    function: FunctionBody


class NamedFunction(OpenAIBody):
    name: str = Field(min_length=1)


class NamedToolChoice(OpenAIBody):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(OpenAIBody):
    include_usage: bool = False


class _SamplingBody(OpenAIBody):
    """The fields chat and text completions share."""

    model: str = ""  # required unless the client's profile names one (checked after the profile)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    n: int | None = Field(default=None, ge=1)
    # Fields OpenAI defines that this server honours only at their neutral value (UNHONOURED).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Loadmaster's extensions (stripped before the engine).
    x_client_id: str | None = Field(default=None, max_length=256)
    x_priority: int | None = Field(default=None, ge=0, le=255)
    x_urgency: float | None = Field(default=None, ge=0.0, le=1.0)
    x_deadline_ms: float | None = Field(default=None, gt=0.0)
    # The model's idle keep-alive from now on, in seconds (< 0: never idle-unloaded).
    x_keep_alive_s: float | None = Field(default=None, allow_inf_nan=False)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list):
            if len(value) > MAX_STOP_SEQUENCES:
                raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
            if any(not s for s in value):
                raise ValueError("stop sequences must not be empty")
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
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    # vLLM's extension: extra variables for the model's chat template (`enable_thinking` …).
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(set(value or ()) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"'{reserved[0]}' is set by the server, not by a request")
        return value

    tools: list[ToolBody] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # Unhonoured unless neutral (UNHONOURED)
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None


class CompletionBody(_SamplingBody):
    prompt: str | list[str]
    chat_template_kwargs: Any = None  # refused: a text prompt is not rendered with a template

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_template(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("only chat completions render a chat template; send messages")
        return value

    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    # Unhonoured unless neutral (UNHONOURED)
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("exactly one prompt is supported")
        return value


# --- the domain request --------------------------------------------------------------------


# A field OpenAI defines that this server cannot honour, and whether a value is the neutral one
# (accepted: it asks for nothing). Any other value is a 400 naming the field.
UNHONOURED: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "store": (None, False),  # nothing is kept (docs/openai-api.md)
    "service_tier": (None, "auto", "default"),
    "functions": (None, []),  # the deprecated form of `tools`
    "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "echo": (None, False),
    "suffix": (None, ""),
}


def refuse_unhonoured(body: BaseModel, *, fields: dict[str, tuple[Any, ...]] = UNHONOURED) -> None:
    """A 400 naming the first field of `fields` whose value asks for what this server cannot do."""
    for name, neutral in fields.items():
        value = getattr(body, name, None)
        if not any(value == ok and type(value) is type(ok) for ok in neutral) and value is not None:
            raise OpenAIError(
                400,
                f"{name}: {json.dumps(value)[:80]} is not supported by this server (leave it out)",
                param=name,
                code="unsupported_parameter",
            )


def invalid(error: ValidationError) -> OpenAIError:
    """A pydantic validation error as OpenAI's 400, naming the first field at fault."""
    return _invalid(error)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def relevant_error(error: ValidationError) -> tuple[str, str, str]:
    """(where, type, message) of the error that says most: a union's other branches are
    skipped (a list of content parts that fails is not "not a valid string"), and so are
    pydantic's branch tags in the location."""
    errors = error.errors()

    def tag(part: object) -> bool:
        return isinstance(part, str) and ("[" in part or part in _TYPE_TAGS)

    chosen = next((e for e in errors if not any(tag(p) for p in e["loc"])), None)
    if chosen is None:
        chosen = next((e for e in errors if "str" not in e["loc"]), errors[0])
    where = ".".join(str(part) for part in chosen["loc"] if not tag(part))
    return where, chosen["type"], str(chosen["msg"]).replace("Value error, ", "")


def _invalid(error: ValidationError) -> OpenAIError:
    where, kind, text = relevant_error(error)
    param = where or None
    if kind == "missing":
        message = f"'{param}' is a required property"
    elif kind == "too_short" and param == "messages":
        message = "'messages' must contain at least one message"
    else:
        message = f"{param}: {text}" if param else text
    return OpenAIError(400, message, param=param)


def load_json(raw: bytes, error: Callable[[int, str], Exception] = OpenAIError) -> Any:
    """A request body's JSON, or `error(400, why)`: not UTF-8, not JSON, or nested deeper than
    the parser goes (a RecursionError, from a few kilobytes of brackets)."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as problem:
        raise error(400, f"the body is not valid JSON: {problem}") from None


def json_object(raw: bytes, error: Callable[[int, str], Exception]) -> dict[str, Any]:
    """`load_json` for the dialects whose bodies must be objects (Anthropic's, Ollama's)."""
    value = load_json(raw, error)
    if not isinstance(value, dict):
        raise error(400, "the body must be a JSON object")
    return value


_load = load_json


def _n(body: _SamplingBody, max_n: int) -> int:
    n = body.n or 1
    if n > max_n:
        raise OpenAIError(400, f"n: {n} is more than this server's limit of {max_n}", param="n")
    return n


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
        keep_alive_s=body.x_keep_alive_s,
        **content,
    )


def parse_chat(raw: bytes, *, max_n: int = DEFAULT_MAX_N) -> GenerationRequest:
    """A `/v1/chat/completions` body, or `OpenAIError` 400 naming the field."""
    return chat_request(load_json(raw), max_n=max_n)


def chat_request(data: Any, *, max_n: int = DEFAULT_MAX_N) -> GenerationRequest:
    """A chat completions body already parsed from JSON (the other dialects build one), or
    `OpenAIError` 400 naming the field."""
    try:
        body = ChatCompletionBody.model_validate(data)
    except ValidationError as error:
        raise _invalid(error) from None
    refuse_unhonoured(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    images = tuple(ChatImage(index, url) for index, m in enumerate(body.messages) for url in m.image_urls())
    return _request(
        body,
        messages=tuple(_turn(m) for m in body.messages),
        prompt=None,
        tools=_tool_use(body),
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        n=_n(body, max_n),
        images=images,
        chat_template_kwargs=body.chat_template_kwargs,
    )


def _turn(message: ChatMessage) -> ChatTurn:
    calls = tuple(
        ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments, index=index)
        for index, call in enumerate(message.tool_calls or ())
    )
    return ChatTurn(
        role="system" if message.role == "developer" else message.role,
        content=message.text(),
        tool_calls=calls,
        tool_call_id=message.tool_call_id or "",
        name=message.name or "" if message.role == "tool" else "",
    )


def _tool_use(body: ChatCompletionBody) -> ToolUse | None:
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise OpenAIError(400, "tool_choice: is only allowed when tools are given", param="tool_choice")
        if body.parallel_tool_calls is not None:
            raise OpenAIError(
                400, "parallel_tool_calls: is only allowed when tools are given", param="parallel_tool_calls"
            )
        return None
    functions = tuple(
        FunctionSpec(
            name=tool.function.name,
            description=tool.function.description or "",
            parameters=tool.function.parameters,
            strict=bool(tool.function.strict),
        )
        for tool in body.tools
    )
    names = [f.name for f in functions]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise OpenAIError(400, f"tools: function '{repeated[0]}' is given twice", param="tools")
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise OpenAIError(
                400,
                f"tool_choice: function '{choice.function.name}' is not one of the tools",
                param="tool_choice",
            )
        return ToolUse(functions, choice="function", function_name=choice.function.name, parallel=parallel)
    return ToolUse(functions, choice=choice or "auto", parallel=parallel)


def parse_completion(raw: bytes, *, max_n: int = DEFAULT_MAX_N) -> GenerationRequest:
    """A `/v1/completions` body, or `OpenAIError` 400 naming the field."""
    try:
        body = CompletionBody.model_validate(load_json(raw))
    except ValidationError as error:
        raise _invalid(error) from None
    refuse_unhonoured(body)
    n = _n(body, max_n)
    if body.best_of is not None and body.best_of != n:
        raise OpenAIError(400, "best_of: only best_of equal to n is supported", param="best_of")
    prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    return _request(body, messages=None, prompt=prompt, logprobs=body.logprobs, n=n)


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


@dataclass(slots=True)
class ChoiceOut:
    """One choice of a finished reply: its text, calls and log probabilities (None: not asked)."""

    index: int
    text: str
    finish_reason: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


def tool_call_json(call: ToolCall, *, streamed: bool = False) -> dict[str, Any]:
    """A call as OpenAI writes it in a message (`streamed`: in a delta, with its index)."""
    out: dict[str, Any] = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    return {"index": call.index, **out} if streamed else out


def _finite(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def chat_logprobs(items: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict[str, Any]:
    """A choice's `logprobs` in chat's shape: `content`, one entry per token."""
    return {
        "content": [
            {
                "token": item.token,
                "logprob": _finite(item.logprob),
                "bytes": list(item.bytes),
                "top_logprobs": [
                    {"token": top.token, "logprob": _finite(top.logprob), "bytes": list(top.bytes)}
                    for top in item.top
                ],
            }
            for item in items
        ],
        "refusal": None,
    }


def completion_logprobs(
    items: list[TokenLogprob] | tuple[TokenLogprob, ...], *, offset: int = 0
) -> dict[str, Any]:
    """A choice's `logprobs` in text completions' shape; `offset` is where the text starts."""
    offsets = []
    for item in items:
        offsets.append(offset)
        offset += len(item.token)
    return {
        "tokens": [item.token for item in items],
        "token_logprobs": [_finite(item.logprob) for item in items],
        "top_logprobs": [{top.token: _finite(top.logprob) for top in item.top} for item in items],
        "text_offset": offsets,
    }


def _choices(choices: list[ChoiceOut] | None, text: str, finish_reason: str) -> list[ChoiceOut]:
    return choices if choices is not None else [ChoiceOut(0, text, finish_reason)]


def chat_completion(
    *,
    request_id: str,
    model: str,
    text: str = "",
    finish_reason: str = "stop",
    usage: Usage,
    created: int | None = None,
    choices: list[ChoiceOut] | None = None,
) -> dict[str, Any]:
    """A `chat.completion`: one choice from `text` and `finish_reason`, or `choices`."""
    out = []
    for choice in _choices(choices, text, finish_reason):
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        if choice.tool_calls:
            message["content"] = choice.text or None
            message["tool_calls"] = [tool_call_json(call) for call in choice.tool_calls]
        out.append(
            {
                "index": choice.index,
                "message": message,
                "logprobs": None if choice.logprobs is None else chat_logprobs(choice.logprobs),
                "finish_reason": choice.finish_reason,
            }
        )
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": out,
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
    index: int = 0,
    tool_calls: tuple[ToolCall, ...] = (),
    logprobs: tuple[TokenLogprob, ...] | None = None,
) -> dict[str, Any]:
    """One `chat.completion.chunk`: a delta of choice `index` (text, calls; the first carries
    the role), or its final `finish_reason`; with `usage` and nothing else, the usage chunk
    (`choices` empty)."""
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
    }
    if usage is not None and text is None and finish_reason is None and not tool_calls:
        chunk["usage"] = usage.as_dict()
        return chunk
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if text is not None:
        delta["content"] = text
    if tool_calls:
        delta["tool_calls"] = [tool_call_json(call, streamed=True) for call in tool_calls]
    chunk["choices"] = [
        {
            "index": index,
            "delta": delta,
            "logprobs": chat_logprobs(logprobs) if logprobs else None,
            "finish_reason": finish_reason,
        }
    ]
    return chunk


def completion(
    *,
    request_id: str,
    model: str,
    text: str = "",
    finish_reason: str = "stop",
    usage: Usage,
    created: int | None = None,
    choices: list[ChoiceOut] | None = None,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": [
            {
                "index": choice.index,
                "text": choice.text,
                "logprobs": None if choice.logprobs is None else completion_logprobs(choice.logprobs),
                "finish_reason": choice.finish_reason,
            }
            for choice in _choices(choices, text, finish_reason)
        ],
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
    index: int = 0,
    logprobs: tuple[TokenLogprob, ...] | None = None,
    offset: int = 0,
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
    chunk["choices"] = [
        {
            "index": index,
            "text": text,
            "logprobs": completion_logprobs(logprobs, offset=offset) if logprobs else None,
            "finish_reason": finish_reason,
        }
    ]
    return chunk


def model_card(model_id: str, *, state: str, created: int = 0) -> dict[str, Any]:
    """A `/v1/models` entry; `x_state` is the model's slot state in the fleet (READY, IDLE …)."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": "loadmaster", "x_state": state}


def event(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), allow_nan=False).encode() + b"\n\n"
