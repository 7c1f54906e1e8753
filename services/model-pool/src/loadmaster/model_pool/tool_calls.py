"""Tool calls read out of a model's text, in the format its chat template teaches it.

A chat model that was trained to call functions writes its calls as text in one of a few
formats; the model's config.yaml names its own (`tool_format`, default `hermes`):

    hermes   <tool_call>
             {"name": "get_weather", "arguments": {"city": "Paris"}}
             </tool_call>                  (any number of them, text may come before)
    llama    {"name": "get_weather", "parameters": {"city": "Paris"}}
             (the whole reply, optionally after <|python_tag|>; several joined with ";")
    mistral  [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
             (the whole reply; the marker is a special token that decoding may drop,
             so a reply that is a bare JSON array of calls is read the same way)

`ToolCallParser` reads one choice's text as it streams: `feed(text)` returns the text that
is certainly content (text that could still be the start of a call is held back) and the
calls completed so far; `finish()` returns the rest. A call whose JSON does not parse, or
that names a function the request did not offer, stays text: nothing the model writes is
lost or made up. Calls get ids `call_<24 hex>` and their `index` in the reply.

`ToolCallStream` wraps an engine's event stream (TokenChunk ... GenerationEnd) with one
parser per choice: chunks keep their token ids and log probabilities, their text becomes
content and `tool_calls`; a choice that called a tool and stopped ends with finish_reason
`tool_calls`. With `parallel` off, the first call is the reply: later calls and text are
dropped (constrained decoding, engines/tool_grammar.py, never writes them).

`chat_dicts` and `tool_dicts` are what a Hugging Face chat template reads (`messages` with
`tool_calls`, `tool` turns, and `tools`): calls' arguments as objects, as the templates
expect, and tools in OpenAI's `{"type": "function", "function": {...}}` shape.

Pure code: no engine, no tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, Self

from loadmaster.model_pool.generation import (
    ChatMessage,
    ChoiceEnd,
    FinishReason,
    GenerationEvent,
    TokenChunk,
    ToolCall,
    ToolUse,
)

__all__ = [
    "HERMES_CLOSE",
    "HERMES_OPEN",
    "LLAMA_TAG",
    "MISTRAL_TAG",
    "ToolCallParser",
    "ToolCallStream",
    "ToolFormat",
    "call_id",
    "chat_dicts",
    "tool_dicts",
]

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
LLAMA_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"
_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"\s*")


class ToolFormat(StrEnum):
    HERMES = "hermes"
    LLAMA = "llama"
    MISTRAL = "mistral"


def call_id() -> str:
    """A fresh id in OpenAI's form."""
    return f"call_{secrets.token_hex(12)}"


def chat_dicts(messages: tuple[ChatMessage, ...] | list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as a chat template reads them."""
    out: list[dict[str, Any]] = []
    for message in messages:
        item: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            item["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": _arguments_object(call.arguments)},
                }
                for call in message.tool_calls
            ]
        if message.role == "tool":
            item["tool_call_id"] = message.tool_call_id
            if message.name:
                item["name"] = message.name
        out.append(item)
    return out


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        return arguments  # as the client sent it: the template shows the text


def tool_dicts(tools: ToolUse) -> list[dict[str, Any]]:
    """Tools as a chat template reads them (OpenAI's shape, parameters as a schema object)."""
    out = []
    for function in tools.functions:
        spec: dict[str, Any] = {"name": function.name, "parameters": function.schema()}
        if function.description:
            spec["description"] = function.description
        out.append({"type": "function", "function": spec})
    return out


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _call_of(value: Any, names: Collection[str], *, arguments_key: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one parsed call object, or None when it is not a call of
    one of `names` with an object (or JSON text of one) as its arguments."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if value["name"] not in names:
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], _compact(arguments)


def _partial_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


@dataclass(slots=True)
class ToolCallParser:
    """One choice's text -> content and tool calls (the module docstring has the formats)."""

    format: ToolFormat
    names: Collection[str]
    parallel: bool = True
    calls: list[ToolCall] = field(default_factory=list)
    _buffer: str = ""  # text not yet decided
    _inside: bool = False  # hermes: within <tool_call> ... (the buffer holds its body)
    _whole: bool | None = None  # llama/mistral: None until the reply's first character says
    _space: str = ""  # whitespace held until what follows it is known

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Content that is certain now, and the calls completed by `text`."""
        before = len(self.calls)
        if self.format is ToolFormat.HERMES:
            out = self._hermes(text, final=False)
        else:
            out = self._whole_reply(text, final=False)
        return self._content(out), self.calls[before:]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end of the reply."""
        before = len(self.calls)
        if self.format is ToolFormat.HERMES:
            out = self._hermes("", final=True)
        else:
            out = self._whole_reply("", final=True)
        out = self._content(out)
        if self._space and not self.calls:
            out += self._space
        self._space = ""
        return out, self.calls[before:]

    # ---- internals ------------------------------------------------------------------

    def _content(self, text: str) -> str:
        """Whitespace is held until non-space text follows (a reply's whitespace around its
        calls is not content); after the first call with `parallel` off, nothing is."""
        if self.calls and not self.parallel:
            self._space = ""
            return ""
        if not text:
            return ""
        text = self._space + text
        stripped = text.rstrip()
        self._space = text[len(stripped) :]
        return stripped

    def _add(self, name: str, arguments: str) -> None:
        if self.calls and not self.parallel:
            return
        self.calls.append(ToolCall(id=call_id(), name=name, arguments=arguments, index=len(self.calls)))

    def _hermes(self, text: str, *, final: bool) -> str:
        self._buffer += text
        out: list[str] = []
        while True:
            if not self._inside:
                start = self._buffer.find(HERMES_OPEN)
                if start < 0:
                    keep = 0 if final else _partial_prefix(self._buffer, HERMES_OPEN)
                    out.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return "".join(out)
                before = self._buffer[:start]
                if before.strip():
                    out.append(before)
                else:
                    self._space = ""  # whitespace before a call is not content
                self._buffer = self._buffer[start + len(HERMES_OPEN) :]
                self._inside = True
            end = self._buffer.find(HERMES_CLOSE)
            if end < 0:
                if final:  # an unclosed call: one whose JSON is complete still counts
                    body, self._buffer, self._inside = self._buffer, "", False
                    if not self._hermes_call(body):
                        out.append(HERMES_OPEN + body)
                return "".join(out)
            body = self._buffer[:end]
            self._buffer = self._buffer[end + len(HERMES_CLOSE) :]
            self._inside = False
            if not self._hermes_call(body):
                out.append(HERMES_OPEN + body + HERMES_CLOSE)

    def _hermes_call(self, body: str) -> bool:
        try:
            value = json.loads(body)
        except ValueError:
            return False
        call = _call_of(value, self.names, arguments_key="arguments")
        if call is None:
            return False
        self._add(*call)
        return True

    def _whole_reply(self, text: str, *, final: bool) -> str:
        """llama and mistral: a reply is either calls only (then it starts with `{`, `[` or
        the format's tag) or text; which one, its first characters say."""
        self._buffer += text
        if self._whole is None:
            head = self._buffer.lstrip()
            tag = LLAMA_TAG if self.format is ToolFormat.LLAMA else MISTRAL_TAG
            opener = "{" if self.format is ToolFormat.LLAMA else "["
            if not head:
                return ""
            if head.startswith((tag, opener)):
                self._whole = True
            elif tag.startswith(head) and not final:
                return ""  # maybe the tag: wait
            else:
                self._whole = False
        if not self._whole:
            out, self._buffer = self._buffer, ""
            return out
        if not final:
            return ""
        body, self._buffer = self._buffer, ""
        calls = self._parse_whole(body)
        if calls is None:
            return body
        for name, arguments in calls:
            self._add(name, arguments)
        return ""

    def _parse_whole(self, body: str) -> list[tuple[str, str]] | None:
        text = body.strip()
        tag = LLAMA_TAG if self.format is ToolFormat.LLAMA else MISTRAL_TAG
        text = text.removeprefix(tag).strip()
        values: list[Any] = []
        position = 0
        while position < len(text):
            try:
                value, position = _DECODER.raw_decode(text, position)
            except ValueError:
                return None
            values.append(value)
            position = _SPACE.match(text, position).end()  # type: ignore[union-attr]
            if position < len(text) and text[position] == ";":
                position = _SPACE.match(text, position + 1).end()  # type: ignore[union-attr]
        if self.format is ToolFormat.MISTRAL:
            if not all(isinstance(value, list) for value in values):
                return None
            values = [item for value in values for item in value]
        key = "parameters" if self.format is ToolFormat.LLAMA else "arguments"
        calls = [_call_of(value, self.names, arguments_key=key) for value in values]
        if not calls or any(call is None for call in calls):
            return None
        return [call for call in calls if call is not None]


class _EventStream(Protocol):
    def __aiter__(self) -> Any: ...

    async def __anext__(self) -> GenerationEvent: ...

    def ready(self) -> list[GenerationEvent]: ...

    async def aclose(self) -> None: ...


class ToolCallStream:
    """An engine stream whose text is read for tool calls (one parser per choice)."""

    def __init__(
        self,
        stream: _EventStream,
        *,
        format: ToolFormat,
        names: Collection[str],
        parallel: bool = True,
    ) -> None:
        self._stream = stream
        self._format = format
        self._names = tuple(names)
        self._parallel = parallel
        self._parsers: dict[int, ToolCallParser] = {}
        self._sequence = 0
        self._finished = False  # the wrapped stream's terminal has been read
        self._pending: deque[GenerationEvent] = deque()

    @property
    def request_id(self) -> str:
        return str(getattr(self._stream, "request_id", ""))

    @property
    def prompt_tokens(self) -> int:
        return int(getattr(self._stream, "prompt_tokens", 0))

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> GenerationEvent:
        if not self._pending:
            if self._finished:
                raise StopAsyncIteration
            self._pending.extend(self._convert(await self._stream.__anext__()))
        return self._pending.popleft()

    def ready(self) -> list[GenerationEvent]:
        if not self._finished:
            for event in self._stream.ready():
                self._pending.extend(self._convert(event))
        out = list(self._pending)
        self._pending.clear()
        return out

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _parser(self, choice: int) -> ToolCallParser:
        parser = self._parsers.get(choice)
        if parser is None:
            parser = self._parsers[choice] = ToolCallParser(
                self._format, self._names, parallel=self._parallel
            )
        return parser

    def _next(self) -> int:
        self._sequence += 1
        return self._sequence - 1

    def _convert(self, event: GenerationEvent) -> list[GenerationEvent]:
        if isinstance(event, TokenChunk):
            text, calls = self._parser(event.choice).feed(event.text)
            return [dataclasses.replace(event, sequence=self._next(), text=text, tool_calls=tuple(calls))]
        self._finished = True
        out: list[GenerationEvent] = []
        for choice, parser in sorted(self._parsers.items()):
            text, calls = parser.finish()
            if text or calls:
                out.append(
                    TokenChunk(
                        event.request_id, self._next(), (), text, choice=choice, tool_calls=tuple(calls)
                    )
                )
        ends = tuple(self._choice_end(end) for end in event.choices)
        reason = event.finish_reason
        if not event.choices and reason is FinishReason.STOP and self._parser(0).calls:
            reason = FinishReason.TOOL_CALLS
        out.append(dataclasses.replace(event, sequence=self._next(), finish_reason=reason, choices=ends))
        return out

    def _choice_end(self, end: ChoiceEnd) -> ChoiceEnd:
        if end.finish_reason is FinishReason.STOP and self._parser(end.index).calls:
            return dataclasses.replace(end, finish_reason=FinishReason.TOOL_CALLS)
        return end
