"""Ollama's API on the gateway's HTTP port: translation only (docs/dialects.md).

Routes: `GET /` and `HEAD /` ("Ollama is running"), `GET /api/version`, `GET /api/tags`,
`GET /api/ps`, `POST /api/show`, `POST /api/chat`, `POST /api/generate`, `POST /api/embed`
and the older `POST /api/embeddings` (one tensor call to an embedding model, as
`/v1/embeddings`: gateway/embeddings.py). A chat or generate
body becomes an OpenAI chat/completions body (`raw` generate: a completions body) and goes
through the OpenAI parser and the same request plane (frontends/dialect_calls.py); its
events come back as Ollama's NDJSON lines (`stream` is true unless the body says false).

    options.temperature / top_p / seed / num_predict / stop  -> the sampling fields
    format "json" | a JSON Schema                           -> response_format
    images (base64)                                          -> image parts (data URLs)
    tools; an assistant's tool_calls; `tool` turns           -> tools, tool_calls, `tool` turns
    keep_alive (seconds or a duration: "5m", "-1", 0)        -> x_keep_alive_s
    think (true / false)                                     -> chat_template_kwargs.enable_thinking

Models are listed as `NAME:latest`; `NAME` and `NAME:latest` name the same model. A chat
with no messages (a generate with no prompt) loads the model (`done_reason` "load"), or
with `keep_alive` 0 unloads it ("unload"; the `admin` scope). Any other field or option
this server cannot honour is a 400 naming it. Errors are `{"error": "..."}` with the status
(an error after a stream began is its last line). The API key is the bearer token.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import itertools
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from loadmaster.common.errors import InternalError, LoadmasterError
from loadmaster.gateway.auth import ADMIN, INFER, Authenticator, bearer_token
from loadmaster.gateway.catalog import ModelView
from loadmaster.gateway.chat_images import image_kind
from loadmaster.gateway.embeddings import Embedder, EmbeddingRequest, EmbeddingResult
from loadmaster.gateway.frontends.dialect_calls import (
    DialectCalls,
    NotAGeneration,
)
from loadmaster.gateway.frontends.disconnects import ClientGone, unless_client_leaves
from loadmaster.gateway.frontends.openai_common import api_route, read_body
from loadmaster.gateway.frontends.openai_schema import (
    ChatCompletionBody,
    OpenAIError,
    chat_request,
    json_object,
    parse_completion,
    relevant_error,
)
from loadmaster.gateway.frontends.request_headers import hints_from, retry_after, with_hints
from loadmaster.gateway.generation import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    Finished,
    GenerationEvent,
    GenerationRequest,
    TextChunk,
)
from loadmaster.gateway.generation_items import ToolCall
from loadmaster.gateway.validation import off_loop

__all__ = ["OLLAMA_VERSION", "OllamaError", "ollama_routes", "parse_keep_alive"]

log = logging.getLogger(__name__)

OLLAMA_VERSION = "0.12.0"  # the Ollama API level these routes speak
MAX_EMBED_INPUTS = 2048  # inputs per /api/embed request (as /v1/embeddings)
LATEST = ":latest"
VISION_BACKENDS = frozenset({"transformers_vlm"})
HONOURED_OPTIONS = ("temperature", "top_p", "seed", "num_predict", "stop")
# Body fields Ollama defines that these routes cannot honour: a 400 naming them.
_UNHONOURED = {
    "suffix": "fill-in-the-middle is not supported",
    "template": "the model's own chat template is always used",
    "context": "send the conversation as messages (/api/chat) instead of a context",
    "logprobs": "log probabilities are not served on the Ollama routes",
    "top_logprobs": "log probabilities are not served on the Ollama routes",
    "width": "image generation is not served on /api/generate (use /v1/images/generations)",
    "height": "image generation is not served on /api/generate (use /v1/images/generations)",
    "steps": "image generation is not served on /api/generate (use /v1/images/generations)",
}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class OllamaError(Exception):
    """An error in Ollama's shape: `{"error": message}` with `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# --- bodies ----------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class Options(BaseModel):
    """The sampling options Loadmaster honours; any other (present, not null) is a 400."""

    model_config = ConfigDict(extra="allow", frozen=True)

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    num_predict: int | None = Field(default=None, ge=1)
    stop: list[str] | None = Field(default=None, max_length=4)


class Message(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = Field(default=None, max_length=MAX_CONTENT_PARTS)
    thinking: str | None = None
    tool_calls: list[Any] | None = None
    tool_name: str | None = None


class _GenerateBase(_Body):
    model: str = Field(min_length=1)
    stream: bool = True
    format: Any = None
    options: Options | None = None
    keep_alive: float | str | None = None
    think: bool | str | None = None

    @field_validator("format")
    @classmethod
    def _format(cls, value: Any) -> Any:
        if value in (None, "", "json") or isinstance(value, dict):
            return value
        raise ValueError('must be "json" or a JSON Schema (an object)')


class ChatBody(_GenerateBase):
    messages: list[Message] | None = Field(default=None, max_length=MAX_MESSAGES)
    tools: list[Any] | None = None


class GenerateBody(_GenerateBase):
    prompt: str | None = None
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None


class EmbedBody(_Body):
    model: str = Field(min_length=1)
    input: str | list[str]
    truncate: bool | None = None
    dimensions: int | None = Field(default=None, ge=1)
    options: Options | None = None
    keep_alive: float | str | None = None


class EmbeddingsBody(_Body):
    """The older `/api/embeddings`: one prompt, one vector."""

    model: str = Field(min_length=1)
    prompt: str
    options: Options | None = None
    keep_alive: float | str | None = None


class ShowBody(_Body):
    model: str = ""
    name: str = ""  # the older field name


# --- translation -------------------------------------------------------------------------------


def model_name(name: str) -> str:
    """`NAME:latest` and `NAME` are the same model."""
    return name[: -len(LATEST)] if name.endswith(LATEST) else name


def parse_keep_alive(value: float | str | None) -> float | None:
    """Seconds (< 0: never idle-unloaded) from a number of seconds or a Go duration."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError("keep_alive: a number of seconds or a duration such as '5m'")
    if isinstance(value, int | float):
        return float(value)
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    matches = list(_DURATION.finditer(body))
    if not body or "".join(m.group(0) for m in matches) != body:
        raise ValueError(f"keep_alive: {value!r} is not a number of seconds or a duration such as '5m'")
    return sign * sum(float(m.group(1)) * _UNIT_S[m.group(2)] for m in matches)


def _invalid(error: ValidationError) -> OllamaError:
    where, kind, message = relevant_error(error)
    if kind == "missing":
        return OllamaError(400, f"{where} is required")
    return OllamaError(400, f"{where}: {message}" if where else message)


def _refuse_unhonoured(raw: Mapping[str, Any]) -> None:
    for name, reason in _UNHONOURED.items():
        if raw.get(name) not in (None, False, "", []):
            raise OllamaError(400, f"{name}: {reason}")


def _data_url(image: str, where: str) -> str:
    """An Ollama image (base64, no prefix) as a data URL whose media type its bytes say."""
    try:
        head = base64.b64decode(image[:24] + "=" * (-len(image[:24]) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise OllamaError(400, f"{where}: not base64") from None
    return f"data:image/{image_kind(head) or 'unknown'};base64,{image}"


def _sampling(body: _GenerateBase) -> dict[str, Any]:
    """The OpenAI fields for `options`, `format`, `keep_alive` and `think`."""
    out: dict[str, Any] = {"model": model_name(body.model), "stream": body.stream}
    options = body.options
    if options is not None:
        for name, value in (options.model_extra or {}).items():
            if value is not None:
                raise OllamaError(
                    400, f"options.{name}: not supported (Loadmaster honours {', '.join(HONOURED_OPTIONS)})"
                )
        if options.temperature is not None:
            out["temperature"] = options.temperature
        if options.top_p is not None:
            out["top_p"] = options.top_p
        if options.seed is not None:
            out["seed"] = options.seed
        if options.num_predict is not None:
            out["max_tokens"] = options.num_predict
        if options.stop:
            out["stop"] = options.stop
    if body.format == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        out["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "ollama", "schema": body.format},
        }
    try:
        keep_alive = parse_keep_alive(body.keep_alive)
    except ValueError as error:
        raise OllamaError(400, str(error)) from None
    if keep_alive is not None:
        out["x_keep_alive_s"] = keep_alive
    if body.think is not None:
        if not isinstance(body.think, bool):
            raise OllamaError(400, f"think: {body.think!r}: only true or false is supported")
        if "chat_template_kwargs" not in ChatCompletionBody.model_fields:
            raise OllamaError(400, "think: this server has no thinking switch")
        out["chat_template_kwargs"] = {"enable_thinking": body.think}
    return out


def _message(message: Message, index: int, calls: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """One Ollama message as an OpenAI one. Ollama's calls carry no ids: an assistant's calls
    get `call_<message>_<n>`, and a `tool` turn answers the oldest unanswered call of its
    `tool_name` (`calls`: function name -> ids still unanswered)."""
    where = f"messages[{index}]"
    if message.thinking:
        raise OllamaError(400, f"{where}.thinking: earlier thinking cannot be sent back to the model")
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        if message.role != "assistant":
            raise OllamaError(400, f"{where}.tool_calls: only an assistant message makes calls")
        out["tool_calls"] = [
            _call(call, f"{where}.tool_calls[{n}]", f"call_{index}_{n}", calls)
            for n, call in enumerate(message.tool_calls)
        ]
    if message.role == "tool":
        name = message.tool_name or ""
        pending = (calls or {}).get(name) or []
        out["name"] = name
        out["tool_call_id"] = pending.pop(0) if pending else ""
    if message.images:
        parts: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": _data_url(image, f"{where}.images[{n}]")}}
            for n, image in enumerate(message.images)
        ]
        parts.append({"type": "text", "text": message.content})
        out["content"] = parts
    return out


def _call(call: Any, where: str, call_id: str, calls: dict[str, list[str]] | None) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise OllamaError(400, f"{where}.function: a name and arguments are required")
    arguments = function.get("arguments") or {}
    if not isinstance(arguments, dict):
        raise OllamaError(400, f"{where}.function.arguments: an object is required")
    if calls is not None:
        calls.setdefault(function["name"], []).append(call_id)
    text = json.dumps(arguments, separators=(",", ":"))
    return {"id": call_id, "type": "function", "function": {"name": function["name"], "arguments": text}}


def chat_body(raw: Mapping[str, Any], body: ChatBody) -> dict[str, Any]:
    """An Ollama chat body as an OpenAI chat/completions body (its `tools` have OpenAI's shape)."""
    _refuse_unhonoured(raw)
    out = _sampling(body)
    calls: dict[str, list[str]] = {}
    out["messages"] = [_message(m, i, calls) for i, m in enumerate(body.messages or [])]
    if body.tools:
        out["tools"] = body.tools
    return out


def generate_body(raw: Mapping[str, Any], body: GenerateBody) -> dict[str, Any]:
    """An Ollama generate body as an OpenAI body: chat (the model's template applied to the
    prompt as the user's turn, `system` before it) or, with `raw`, a text completion."""
    _refuse_unhonoured(raw)
    out = _sampling(body)
    prompt = body.prompt or ""
    if body.raw:
        if body.system:
            raise OllamaError(400, "system: a raw prompt takes no system prompt (put it in the prompt)")
        if body.images:
            raise OllamaError(400, "images: a raw prompt takes no images")
        out["prompt"] = prompt
        return out
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": body.system})
    messages.append(_message(Message(role="user", content=prompt, images=body.images), 0))
    out["messages"] = messages
    return out


def embedding_request(body: EmbedBody | EmbeddingsBody) -> EmbeddingRequest:
    """An embed body as an `EmbeddingRequest`, or a 400 naming what cannot be honoured."""
    if body.options is not None:
        given = [name for name, value in body.options.model_dump().items() if value is not None]
        if given:
            raise OllamaError(400, f"options.{given[0]}: an embedding model takes no options")
    if body.keep_alive is not None:
        raise OllamaError(400, "keep_alive: not supported on the embedding routes (the model's own applies)")
    if isinstance(body, EmbeddingsBody):
        if not body.prompt:
            raise OllamaError(400, "prompt: empty (an input needs text)")
        return EmbeddingRequest(model=model_name(body.model), inputs=(body.prompt,))
    if body.truncate:
        raise OllamaError(
            400,
            "truncate: inputs are never cut; one longer than the model takes is a 400 (send truncate: false)",
        )
    inputs = (body.input,) if isinstance(body.input, str) else tuple(body.input)
    if not inputs:
        raise OllamaError(400, "input: at least one input is required")
    if len(inputs) > MAX_EMBED_INPUTS:
        raise OllamaError(400, f"input: {len(inputs)} inputs, at most {MAX_EMBED_INPUTS} per request")
    for index, text in enumerate(inputs):
        if not text:
            raise OllamaError(400, f"input[{index}]: empty (an input needs text)")
    return EmbeddingRequest(model=model_name(body.model), inputs=inputs, dimensions=body.dimensions)


def render_embed(model: str, result: EmbeddingResult, started_ns: int, *, single: bool) -> str:
    """`/api/embed`'s reply (or `/api/embeddings`' with `single`) as JSON text: it grows with the
    inputs, so it is made off the event loop."""
    vectors = result.vectors.astype("<f4", copy=False).tolist()
    if single:
        return json.dumps({"embedding": vectors[0]}, separators=(",", ":"))
    reply = {
        "model": model,
        "embeddings": vectors,
        "total_duration": time.monotonic_ns() - started_ns,
        "load_duration": 0,
        "prompt_eval_count": result.prompt_tokens,
    }
    return json.dumps(reply, separators=(",", ":"))


# OpenAI parser fields -> the Ollama field a client sent (for a 400 the parser raised).
_FIELD_NAMES = {
    "max_tokens": "options.num_predict",
    "temperature": "options.temperature",
    "top_p": "options.top_p",
    "seed": "options.seed",
    "stop": "options.stop",
    "response_format": "format",
    "x_keep_alive_s": "keep_alive",
}


def _openai_error(error: OpenAIError) -> OllamaError:
    message = error.message
    if error.param:
        head = error.param.split(".")[0]
        if head in _FIELD_NAMES:
            message = message.replace(error.param, _FIELD_NAMES[head] + error.param[len(head) :], 1)
    return OllamaError(error.status, message)


def parse(openai_body: dict[str, Any]) -> GenerationRequest:
    try:
        if "messages" in openai_body:
            return chat_request(openai_body)
        return parse_completion(json.dumps(openai_body, separators=(",", ":")).encode())
    except OpenAIError as error:
        raise _openai_error(error) from None


# --- replies -------------------------------------------------------------------------------


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def _details(view: ModelView | None) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": "safetensors" if view is not None and view.backend.startswith("transformers") else "",
        "family": "",
        "families": None,
        "parameter_size": "",
        "quantization_level": "",
    }


def _error_line(error: LoadmasterError) -> bytes:
    return json.dumps({"error": error.message}).encode() + b"\n"


class _Timing:
    """Ollama's durations (ns) and counts for a reply's last object."""

    def __init__(self, started_ns: int) -> None:
        self.started = started_ns
        self.first = 0

    def mark(self) -> None:
        if not self.first:
            self.first = time.monotonic_ns()

    def final(self, finished: Finished) -> dict[str, Any]:
        now = time.monotonic_ns()
        first = self.first or now
        return {
            "done": True,
            "done_reason": "stop" if finished.finish_reason == "tool_calls" else finished.finish_reason,
            "total_duration": now - self.started,
            "load_duration": 0,
            "prompt_eval_count": finished.prompt_tokens,
            "prompt_eval_duration": first - self.started,
            "eval_count": finished.completion_tokens,
            "eval_duration": now - first,
        }


def ollama_routes(
    calls: DialectCalls,
    auth: Authenticator,
    *,
    models: Callable[[], Awaitable[dict[str, str]]],
    views: Callable[[], Awaitable[dict[str, ModelView]]],
    load: Callable[..., Awaitable[object]],
    unload: Callable[[str], Awaitable[object]],
    gateway_id: str,
    max_body_bytes: int,
    embedder: Embedder | None = None,
) -> list[Route]:
    ids = (f"{gateway_id}-o{n}" for n in itertools.count(1))

    async def served(name: str) -> tuple[str, str, ModelView | None]:
        wanted = model_name(name)
        states = await models()
        if wanted not in states:
            raise OllamaError(404, f"model '{name}' not found")
        return wanted, states[wanted], (await views()).get(wanted)

    async def generation(request: Request, *, chat: bool) -> Response:
        started = time.monotonic_ns()
        token = bearer_token(request.headers.get("authorization"))
        bodies: list[ChatBody | GenerateBody] = []

        async def parsed() -> GenerationRequest:  # after authentication: then the body is read
            raw = json_object(await read_body(request, max_body_bytes), OllamaError)
            try:
                body: ChatBody | GenerateBody = (ChatBody if chat else GenerateBody).model_validate(raw)
            except ValidationError as error:
                raise _invalid(error) from None
            bodies.append(body)
            empty = (
                not body.messages if isinstance(body, ChatBody) else body.prompt is None and not body.images
            )
            if empty:
                raise NotAGeneration()
            return parse(chat_body(raw, body) if isinstance(body, ChatBody) else generate_body(raw, body))

        try:
            opened = await calls.open(
                request,
                endpoint="ollama.chat" if chat else "ollama.generate",
                request_id=next(ids),
                token=token,
                parse=parsed,
            )
        except NotAGeneration:
            return await load_or_unload(token, bodies[0], chat=chat)
        timing = _Timing(started)
        name = bodies[0].model
        stream = bodies[0].stream

        def reply(text: str, *, done: bool, tool_calls: tuple[ToolCall, ...] = ()) -> dict[str, Any]:
            head: dict[str, Any] = {"model": name, "created_at": _now()}
            if chat:
                head["message"] = {"role": "assistant", "content": text}
                if tool_calls:
                    head["message"]["tool_calls"] = [
                        {"function": {"name": c.name, "arguments": c.arguments_object()}} for c in tool_calls
                    ]
            else:
                head["response"] = text
            head["done"] = done
            return head

        if not stream:
            whole = await calls.collect(request, opened)
            timing.first = timing.first or time.monotonic_ns()
            return JSONResponse(
                {**reply(whole.text, done=True, tool_calls=whole.tool_calls), **timing.final(whole.finished)}
            )

        async def lines(events: AsyncIterator[GenerationEvent]) -> AsyncIterator[bytes]:
            async for item in events:
                if isinstance(item, TextChunk):
                    timing.mark()
                    if item.text or item.tool_calls:
                        line = reply(item.text, done=False, tool_calls=item.tool_calls)
                        yield json.dumps(line).encode() + b"\n"
                elif isinstance(item, Finished):
                    yield json.dumps({**reply("", done=True), **timing.final(item)}).encode() + b"\n"

        return StreamingResponse(
            calls.stream(opened, lines, _error_line),
            media_type="application/x-ndjson",
            headers={"X-Loadmaster-Model": opened.generation.model},
        )

    async def load_or_unload(token: str | None, body: ChatBody | GenerateBody, *, chat: bool) -> Response:
        """Ollama's way to load a model (no messages / no prompt), or with keep_alive 0 to unload
        it (the caller is authenticated for `infer` already; unloading also needs `admin`)."""
        try:
            keep_alive = parse_keep_alive(body.keep_alive)
        except ValueError as error:
            raise OllamaError(400, str(error)) from None
        unloading = keep_alive == 0
        if unloading:
            await auth.authenticate(token, ADMIN, charge=False)
        wanted, _, view = await served(body.model)
        if view is None:  # an alias: nothing to load or unload by that name
            raise OllamaError(400, f"model '{body.model}' is an alias: load or unload the models it names")
        if unloading:
            await unload(wanted)
        else:
            await load(wanted, keep_alive_s=keep_alive)
        head: dict[str, Any] = {"model": body.model, "created_at": _now()}
        if chat:
            head["message"] = {"role": "assistant", "content": ""}
        else:
            head["response"] = ""
        return JSONResponse({**head, "done": True, "done_reason": "unload" if unloading else "load"})

    async def chat(request: Request) -> Response:
        return await generation(request, chat=True)

    async def generate(request: Request) -> Response:
        return await generation(request, chat=False)

    async def tags(request: Request) -> Response:
        await auth.authenticate(bearer_token(request.headers.get("authorization")), INFER)
        states, known = await models(), await views()
        listed = [
            {
                "name": name + LATEST,
                "model": name + LATEST,
                "modified_at": "1970-01-01T00:00:00Z",
                "size": 0,
                "digest": _digest(name),
                "details": _details(known.get(name)),
            }
            for name in sorted(states)
        ]
        return JSONResponse({"models": listed})

    async def ps(request: Request) -> Response:
        await auth.authenticate(bearer_token(request.headers.get("authorization")), INFER)
        states, known = await models(), await views()
        running = [
            {
                "name": name + LATEST,
                "model": name + LATEST,
                "size": 0,
                "digest": _digest(name),
                "details": _details(known.get(name)),
                "expires_at": None,  # each worker keeps its own idle clock (keep_alive_s)
                "size_vram": 0,
            }
            for name, state in sorted(states.items())
            if state == "READY"
        ]
        return JSONResponse({"models": running})

    async def show(request: Request) -> Response:
        await auth.authenticate(bearer_token(request.headers.get("authorization")), INFER)
        try:
            body = ShowBody.model_validate(json_object(await read_body(request, max_body_bytes), OllamaError))
        except ValidationError as error:
            raise _invalid(error) from None
        name = body.model or body.name
        if not name:
            raise OllamaError(400, "model is required")
        _, state, view = await served(name)
        capabilities = ["completion"]
        if view is not None and view.backend in VISION_BACKENDS:
            capabilities.append("vision")
        if view is not None and view.backend == "embedding":
            capabilities = ["embedding"]
        return JSONResponse(
            {
                "modelfile": "",
                "parameters": "",
                "template": "",
                "details": _details(view),
                "model_info": {
                    "loadmaster.state": state,
                    "loadmaster.backend": view.backend if view else "alias",
                },
                "capabilities": capabilities,
                "modified_at": "1970-01-01T00:00:00Z",
            }
        )

    async def embed(request: Request, *, single: bool) -> Response:
        """`/api/embed` (`single`: the older `/api/embeddings`): one tensor call to the embedding
        model through the dispatcher (queued, prioritised, batched on the worker), as
        `/v1/embeddings`; a client that leaves cancels it."""
        started = time.monotonic_ns()
        token = bearer_token(request.headers.get("authorization"))
        principal = await auth.authenticate(token, INFER)
        if embedder is None:
            raise OllamaError(404, "embeddings are not served by this gateway")
        raw = json_object(await read_body(request, max_body_bytes), OllamaError)
        try:
            body: EmbedBody | EmbeddingsBody = (EmbeddingsBody if single else EmbedBody).model_validate(raw)
        except ValidationError as error:
            raise _invalid(error) from None
        wanted = with_hints(embedding_request(body), hints_from(request.headers))
        client_id = wanted.client_id or principal.name or "ollama"
        work = embedder.embed(wanted, request_id=next(ids), client_id=client_id)
        vectors = await unless_client_leaves(request, work)  # ClientGone: the call is cancelled
        text = await off_loop(render_embed, body.model, vectors, started, single=single)
        return Response(text, media_type="application/json", headers={"X-Loadmaster-Model": wanted.model})

    async def embed_route(request: Request) -> Response:
        return await embed(request, single=False)

    async def embeddings_route(request: Request) -> Response:
        return await embed(request, single=True)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_VERSION})

    async def root(request: Request) -> Response:
        return PlainTextResponse("Ollama is running")

    return [
        api_route("/", root, ["GET", "HEAD"], _error_response),
        api_route("/api/version", version, ["GET"], _error_response),
        api_route("/api/tags", tags, ["GET"], _error_response),
        api_route("/api/ps", ps, ["GET"], _error_response),
        api_route("/api/show", show, ["POST"], _error_response),
        api_route("/api/chat", chat, ["POST"], _error_response),
        api_route("/api/generate", generate, ["POST"], _error_response),
        api_route("/api/embed", embed_route, ["POST"], _error_response),
        api_route("/api/embeddings", embeddings_route, ["POST"], _error_response),
    ]


def _error_response(error: Exception) -> Response:
    if isinstance(error, ClientGone):
        return Response(status_code=499)
    if isinstance(error, OllamaError):
        return JSONResponse({"error": error.message}, status_code=error.status)
    if isinstance(error, OpenAIError):
        return JSONResponse({"error": _openai_error(error).message}, status_code=error.status)
    known = error if isinstance(error, LoadmasterError) else None
    if known is None:
        log.error("unhandled error in the Ollama API", exc_info=error)
        known = InternalError(f"internal error: {type(error).__name__}")
    return JSONResponse({"error": known.message}, status_code=known.http_status, headers=retry_after(known))
