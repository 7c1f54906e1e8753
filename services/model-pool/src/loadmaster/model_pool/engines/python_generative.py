"""Python generative engine: a class in the model's folder whose `generate` yields text.

    # models/replay-chat/model.py
    class ReplayChat:
        supports_tools = True                       # its "template" shows tools (else: 400 naming tools)
        def load(self) -> None: ...                 # optional
        def generate(self, request: dict) -> Iterable[str]: ...
        def unload(self) -> None: ...               # optional

`backend: python_generative` in config.yaml (`module`, `class`, `max_sequences`,
`tool_format`). `request` is plain data: `messages` (as a chat template reads them, tool
calls and `tool` turns included) or `prompt`, `tools` (OpenAI's shape, or None),
`max_tokens`, `temperature`, `top_p`, `seed`, `stop`. Each piece the generator yields is
one "token": `max_tokens` pieces end the reply with `length`, and usage counts pieces (the
prompt counts 0: there is no tokenizer). Stop strings are matched across pieces as for any
engine; with tools, calls are read out of the text in the config's `tool_format`
(tool_calls.py). What cannot be honoured without a tokenizer and logits is refused with a
400 naming the field: `logprobs`, forced tool calls (`tool_choice` required or a function:
decoding cannot be constrained), `response_format`, `n` > 1.

The generator runs on a thread of its own per stream (it may block: a model calling out,
a script sleeping between pieces), never on the event loop; a cancel is seen between
pieces. At most `max_sequences` streams run at once (the worker's sequencer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadmaster.common.errors import InvalidArgumentError, LoadmasterError, UnavailableError
from loadmaster.model_pool.engines._token_streams import QueuedGeneration
from loadmaster.model_pool.engines.python import PythonEngine
from loadmaster.model_pool.generation import (
    FinishReason,
    GenerationEnd,
    GenerationEvent,
    GenerationRequest,
    StopMatcher,
    TokenChunk,
    Usage,
)
from loadmaster.model_pool.repository import PythonGenerativeModelConfig
from loadmaster.model_pool.tool_calls import ToolCallStream, ToolFormat, chat_dicts, tool_dicts

__all__ = ["PythonGenerativeEngine"]

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Stream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[GenerationEvent] = field(default_factory=asyncio.Queue)
    stop: threading.Event = field(default_factory=threading.Event)
    done: bool = False
    sequence: int = 0
    pieces: int = 0

    def post(self, event: GenerationEvent) -> None:
        """From the generator's thread."""
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
            self.loop.call_soon_threadsafe(self._put, event)

    def _put(self, event: GenerationEvent) -> None:
        if self.done:
            return
        self.done = isinstance(event, GenerationEnd)
        self.events.put_nowait(event)


class _PythonStream(QueuedGeneration):
    def __init__(self, state: _Stream, cancel: Any) -> None:
        super().__init__(state)
        self._state = state
        self._cancel = cancel

    @property
    def prompt_tokens(self) -> int:
        return 0

    def _stop(self) -> None:
        self._cancel(self._state.request_id)


class PythonGenerativeEngine(PythonEngine):
    backend = "python_generative"
    required_method = "generate"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._streams: dict[str, _Stream] = {}

    def _config_of(self) -> PythonGenerativeModelConfig:
        config = self.spec.config
        assert isinstance(config, PythonGenerativeModelConfig)
        return config

    def warmup(self) -> None:
        """Nothing to warm: the first piece is the model's own business."""

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise InvalidArgumentError(
            f"model '{self.spec.model_id}' is generative (backend python_generative): send it a "
            "generation request, not tensors"
        )

    def unload(self) -> None:
        for stream in list(self._streams.values()):
            stream.stop.set()
        super().unload()

    # ---- generation (on the event loop) ---------------------------------

    async def submit(self, request: GenerationRequest) -> Any:
        request.check()
        model = self._model
        if model is None:
            raise UnavailableError(f"model '{self.spec.model_id}' is not loaded")
        self._refuse_unhonoured(request, model)
        if request.request_id in self._streams:
            raise InvalidArgumentError(f"request_id: {request.request_id!r} is already generating")
        state = _Stream(request.request_id, asyncio.get_running_loop())
        self._streams[request.request_id] = state
        thread = threading.Thread(
            target=self._run,
            args=(model, request, state),
            name=f"generate-{request.request_id[:32]}",
            daemon=True,
        )
        thread.start()
        stream = _PythonStream(state, self.cancel)
        if request.tools is None or not request.tool_calls_parsed:
            return stream
        return ToolCallStream(
            stream,
            format=ToolFormat(self._config_of().tool_format),
            names=[f.name for f in request.tools.functions],
            parallel=request.tools.parallel,
        )

    def cancel(self, request_id: str) -> bool:
        state = self._streams.get(request_id)
        if state is None:
            return False
        state.stop.set()
        return True

    def _refuse_unhonoured(self, request: GenerationRequest, model: Any) -> None:
        name = self.spec.model_id
        if request.logprobs is not None:
            raise InvalidArgumentError(
                f"logprobs: model '{name}' (a Python model) has no token probabilities"
            )
        if request.response_format is not None:
            raise InvalidArgumentError(
                f"response_format: model '{name}' (a Python model) cannot constrain its reply"
            )
        if request.n > 1:
            raise InvalidArgumentError(f"n: model '{name}' (a Python model) answers one choice")
        if request.tools is not None:
            if not getattr(model, "supports_tools", False):
                raise InvalidArgumentError(f"tools: model '{name}' has no tool support")
            if request.tools.constrained:
                raise InvalidArgumentError(
                    f"tool_choice: model '{name}' (a Python model) cannot be forced to call a tool"
                )

    # ---- the generator's thread ------------------------------------------

    def _run(self, model: Any, request: GenerationRequest, state: _Stream) -> None:
        params = request.params
        stops = StopMatcher(params.stop)
        reason = FinishReason.STOP
        error = ""
        try:
            pieces: Iterator[Any] = iter(model.generate(_plain(request)))
            for piece in pieces:
                if state.stop.is_set():
                    reason = FinishReason.CANCELLED
                    break
                if not isinstance(piece, str):
                    raise TypeError(f"generate() yielded {type(piece).__name__}, expected str")
                state.pieces += 1
                text, stopped = stops.feed(piece)
                self._chunk(state, text)
                if stopped:
                    break
                if state.pieces >= params.max_tokens:
                    reason = FinishReason.LENGTH
                    break
            else:
                if state.stop.is_set():
                    reason = FinishReason.CANCELLED
            if reason is not FinishReason.CANCELLED:
                self._chunk(state, stops.flush())
            close = getattr(pieces, "close", None)
            if callable(close):
                close()
        except LoadmasterError as failure:
            reason, error = FinishReason.ERROR, failure.message
        except Exception as failure:
            log.exception("model %s: generate() failed", self.spec.model_id)
            reason, error = FinishReason.ERROR, f"{type(failure).__name__}: {failure}"
        usage = Usage(prompt_tokens=0, completion_tokens=state.pieces)
        if reason is FinishReason.CANCELLED:
            error = "cancelled"
        state.post(GenerationEnd(request.request_id, state.sequence, reason, usage, error))
        state.loop.call_soon_threadsafe(self._streams.pop, request.request_id, None)

    @staticmethod
    def _chunk(state: _Stream, text: str) -> None:
        if text:
            state.post(TokenChunk(state.request_id, state.sequence, (), text))
            state.sequence += 1


def _plain(request: GenerationRequest) -> dict[str, Any]:
    params = request.params
    return {
        "messages": chat_dicts(request.messages) if request.messages is not None else None,
        "prompt": request.prompt,
        "tools": tool_dicts(request.tools) if request.tools is not None else None,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "seed": params.seed,
        "stop": list(params.stop),
    }
