"""One generation proxied to an engine process: its OpenAI request body, and the SSE it
answers turned into the data plane's events.

    body = request_body(request, model=served, response_format=...)   # pure
    stream = ProxyStream(request_id, prompt_tokens_hint=0, stop=...)
    stream.feed(chunk_json)   -> TokenChunk events (text deltas; stop strings matched here too)
    stream.end(...)           -> exactly one GenerationEnd

The engine is always asked to stream (`stream: true`, usage in the last chunk), whether the
caller streams or not: the gateway builds a whole reply from chunks itself. Stop strings go
to the engine and are matched here as well, since not every engine honours them
(`transformers serve` ignores `stop`); the stream stops at the first one either way.
Engine chunks carry text, not token ids, so `TokenChunk.token_ids` is empty and usage
comes from the engine's final chunk.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.model_pool.engines._token_streams import QueuedGeneration
from loadmaster.model_pool.generation import (
    FinishReason,
    GenerationEnd,
    GenerationEvent,
    GenerationRequest,
    StopMatcher,
    TokenChunk,
    Usage,
)

__all__ = ["ProxyGeneration", "ProxyStream", "openai_response_format", "request_body"]

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


def openai_response_format(value: Any) -> dict[str, Any] | None:
    """A request's structured-output demand (the domain `ResponseFormat`: `kind`, `schema` as
    JSON text, `name`) in OpenAI's shape, for the engine to enforce: `{"type": "json_object"}`
    or `{"type": "json_schema", "json_schema": {"name", "schema"}}`. None: free text."""
    if value is None:
        return None
    kind = getattr(value, "kind", "")
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = getattr(value, "schema", "")
        try:
            parsed = json.loads(schema) if isinstance(schema, str) else schema
        except ValueError as error:
            raise InvalidArgumentError(f"response_format.json_schema.schema: not JSON ({error})") from None
        return {
            "type": "json_schema",
            "json_schema": {"name": getattr(value, "name", "") or "response", "schema": parsed},
        }
    return None


def request_body(
    request: GenerationRequest,
    *,
    model: str,
    response_format: dict[str, Any] | None = None,
    forward_priority: bool = False,
) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of the OpenAI request for `request`: chat messages go to
    /v1/chat/completions, a text prompt or prompt token ids to /v1/completions. Only fields
    every OpenAI-compatible engine knows are sent (some, like `transformers serve`, refuse
    unknown ones with 422), and `priority` when the engine takes one (`forward_priority`:
    vLLM with `--scheduling-policy priority`, where lower also runs first)."""
    params = request.params
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    if response_format is not None:
        body["response_format"] = response_format
    if forward_priority:
        body["priority"] = request.priority
    if request.messages is not None:
        body["messages"] = [{"role": m.role, "content": m.content} for m in request.messages]
        if request.chat_template_kwargs:  # only when asked: not every engine knows the field
            body["chat_template_kwargs"] = dict(request.chat_template_kwargs)
        return "/v1/chat/completions", body
    if request.prompt_token_ids is not None:
        body["prompt"] = list(request.prompt_token_ids)
    else:
        body["prompt"] = request.prompt
    return "/v1/completions", body


@dataclass(slots=True, eq=False)
class ProxyStream:
    """Events of one proxied generation, on the event loop. `on_done` runs once, at the end."""

    request_id: str
    stop: tuple[str, ...]
    on_done: Callable[[ProxyStream], None]
    events: asyncio.Queue[GenerationEvent] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None
    done: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    chunks: int = 0
    _sequence: int = 0
    _finish: FinishReason | None = None
    _stops: StopMatcher = field(init=False)

    def __post_init__(self) -> None:
        self._stops = StopMatcher(self.stop)

    def feed(self, chunk: dict[str, Any]) -> bool:
        """One SSE chunk of the engine; True when the stream is complete (a stop string or
        the engine's finish_reason with its usage seen, or an error chunk)."""
        if self.done:
            return True
        error = chunk.get("error")
        if error is not None:
            message = error.get("message", error) if isinstance(error, dict) else error
            self.end(FinishReason.ERROR, f"the engine failed the request: {message}")
            return True
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.completion_tokens = int(usage.get("completion_tokens") or 0)
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta")
            text = (delta or {}).get("content") if delta is not None else choice.get("text")
            if text:
                self.chunks += 1
                safe, stopped = self._stops.feed(text)
                self._chunk(safe)
                if stopped:
                    self.end(FinishReason.STOP)
                    return True
            reason = choice.get("finish_reason")
            if reason:
                self._finish = _FINISH.get(reason, FinishReason.STOP)
        return False

    def finished(self) -> None:
        """The engine's stream ended ([DONE] or end of body): the terminal, with its usage."""
        self._chunk(self._stops.flush())
        if self._finish is None:
            self.end(FinishReason.ERROR, "the engine's stream ended without a finish_reason")
        else:
            self.end(self._finish)

    def end(self, reason: FinishReason, error: str = "") -> None:
        if self.done:
            return
        self.done = True
        completion = self.completion_tokens or self.chunks
        usage = Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion)
        self.events.put_nowait(GenerationEnd(self.request_id, self._sequence, reason, usage, error))
        self.on_done(self)

    def _chunk(self, text: str) -> None:
        if text:
            self.events.put_nowait(TokenChunk(self.request_id, self._sequence, (), text))
            self._sequence += 1


class ProxyGeneration(QueuedGeneration):
    """What a caller iterates (as `engines._token_streams.GenerationStream`); leaving it
    early cancels the generation, which closes the connection to the engine."""

    def __init__(self, state: ProxyStream, cancel: Callable[[str], bool]) -> None:
        super().__init__(state)
        self._state = state
        self._cancel = cancel

    def _stop(self) -> None:
        self._cancel(self._state.request_id)
