"""One generation's stream: the manager's cumulative outputs -> chunks, then one terminal.

`StreamState` lives on the event loop. transformers' manager calls `on_output` there (via
`call_soon_threadsafe`, one call per decode step for all the step's sequences) with the
*cumulative* generated tokens; the state turns the new ones into text (incrementally, so a
multi-byte character split over tokens is emitted whole), looks for stop strings and
queues `TokenChunk`s, then exactly one `GenerationEnd`. Every path that ends a stream —
eos, max_tokens, a stop string, cancel, a failed request, unload — goes through `_end`,
which runs once. A sequence paused for other work stays in the manager (its scheduler,
`_cb_scheduler.py`, leaves it out of the batch), so its outputs simply continue.

A request with `n` choices has one `StreamState` per choice (each its own sequence in the
manager), joined by a `ChoiceGroup`: their chunks go to the group's one queue, numbered in
one sequence and marked with their `choice`, and the group's one terminal follows the last
choice's end, with how each ended (`GenerationEnd.choices`) and their usage summed. A choice
that fails ends the others.

`GenerationStream` is what a caller iterates; closing it early cancels the generation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, Self

from loadmaster.model_pool.generation import (
    ChoiceEnd,
    FinishReason,
    GenerationEnd,
    GenerationEvent,
    SamplingParams,
    StopMatcher,
    TokenChunk,
    TokenLogprob,
    Usage,
)

__all__ = ["ChoiceGroup", "GenerationStream", "QueuedGeneration", "StreamState"]

_REPLACEMENT = "\ufffd"  # what a decoder returns for an incomplete UTF-8 sequence


@dataclass(slots=True, eq=False)
class StreamState:
    request_id: str
    internal_id: str  # the manager's id (unique per submission)
    prompt_tokens: int
    params: SamplingParams
    tokenizer: Any
    eos_ids: frozenset[int]
    on_done: Callable[[StreamState], None]
    cancel_in_manager: Callable[[str], None]
    loop: asyncio.AbstractEventLoop
    prompt_ids: tuple[int, ...] = ()
    sampling_kwargs: dict[str, Any] = field(default_factory=dict)
    # (manager id, absolute position, token) -> its log probability, when they were asked for
    logprob_of: Callable[[str, int, int], TokenLogprob] | None = None
    choice: int = 0  # with n > 1: which choice, and the group that joins them
    group: ChoiceGroup | None = None
    end_reason: FinishReason | None = None
    events: asyncio.Queue[GenerationEvent] = field(default_factory=asyncio.Queue)
    tokens: list[int] = field(default_factory=list)
    done: bool = False
    _sequence: int = 0
    _prefix_offset: int = 0
    _read_offset: int = 0
    _stops: StopMatcher = field(init=False)

    def __post_init__(self) -> None:
        self._stops = StopMatcher(self.params.stop)

    # ---- from the manager (on the loop) ----------------------------------

    def on_output(self, output: Any) -> None:
        if self.done or output.request_id != self.internal_id:
            return  # late output of a cancelled submission
        if output.error:
            self._end(FinishReason.ERROR, str(output.error))
            return
        generated = output.generated_tokens
        chunk_ids: list[int] = []
        chunk_text: list[str] = []
        logprobs: list[TokenLogprob] = []
        for token in generated[len(self.tokens) :]:
            if self.logprob_of is not None:
                position = len(self.prompt_ids) + len(self.tokens)
                logprobs.append(self.logprob_of(self.internal_id, position, int(token)))
            self.tokens.append(token)
            chunk_ids.append(token)
            text, stopped = self._stops.feed(self._text_delta())
            chunk_text.append(text)
            if stopped:
                self.cancel_in_manager(self.internal_id)  # free the sequence: we have what we need
                self._chunk(chunk_ids, "".join(chunk_text), logprobs)
                self._end(FinishReason.STOP)
                return
        if output.is_finished():
            chunk_text.append(self._stops.feed(self._text_delta(final=True))[0] + self._stops.flush())
            self._chunk(chunk_ids, "".join(chunk_text), logprobs)
            last = self.tokens[-1] if self.tokens else None
            self._end(FinishReason.STOP if last in self.eos_ids else FinishReason.LENGTH)
        else:
            self._chunk(chunk_ids, "".join(chunk_text), logprobs)

    # ---- from the engine -------------------------------------------------

    def cancel(self) -> None:
        if not self.done:
            self.cancel_in_manager(self.internal_id)
            self._end(FinishReason.CANCELLED)

    def fail_threadsafe(self, message: str) -> None:
        """End the stream with an error from any thread (unload runs on the executor)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self.loop.call_soon_threadsafe(self._end, FinishReason.ERROR, message)

    # ---- internals -------------------------------------------------------

    def _text_delta(self, *, final: bool = False) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self.tokens[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full = decode(self.tokens[self._prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and (final or not full.endswith(_REPLACEMENT)):
            self._prefix_offset, self._read_offset = self._read_offset, len(self.tokens)
            return full[len(prefix) :]
        return ""

    def _chunk(self, token_ids: list[int], text: str, logprobs: list[TokenLogprob] | None = None) -> None:
        if not token_ids and not text:
            return
        if self.group is not None:
            self.group.chunk(self, tuple(token_ids), text, tuple(logprobs or ()))
            return
        self.events.put_nowait(
            TokenChunk(
                self.request_id, self._sequence, tuple(token_ids), text, logprobs=tuple(logprobs or ())
            )
        )
        self._sequence += 1

    def _end(self, reason: FinishReason, error: str = "") -> None:
        if self.done:
            return
        self.done = True
        self.end_reason = reason
        if self.group is not None:
            self.on_done(self)
            self.group.ended(self, reason, error)
            return
        usage = Usage(prompt_tokens=self.prompt_tokens, completion_tokens=len(self.tokens))
        end = GenerationEnd(self.request_id, self._sequence, reason, usage, error)
        self.events.put_nowait(end)
        self.on_done(self)


@dataclass(slots=True, eq=False)
class ChoiceGroup:
    """A request's `n` choices as one stream (module docstring). It stands in for a
    `StreamState` where a stream is read or stopped (`GenerationStream`)."""

    request_id: str
    prompt_tokens: int
    states: list[StreamState] = field(default_factory=list)
    events: asyncio.Queue[GenerationEvent] = field(default_factory=asyncio.Queue)
    done: bool = False
    _sequence: int = 0

    def join(self, state: StreamState) -> None:
        state.choice, state.group = len(self.states), self
        self.states.append(state)

    def cancel(self) -> None:
        for state in self.states:
            state.cancel()

    def chunk(
        self, state: StreamState, token_ids: tuple[int, ...], text: str, logprobs: tuple[TokenLogprob, ...]
    ) -> None:
        if self.done:
            return
        self.events.put_nowait(
            TokenChunk(
                self.request_id, self._sequence, token_ids, text, choice=state.choice, logprobs=logprobs
            )
        )
        self._sequence += 1

    def ended(self, state: StreamState, reason: FinishReason, error: str) -> None:
        if reason is FinishReason.ERROR:  # one failed: the reply fails, the others stop now
            for other in self.states:
                if other is not state and not other.done:
                    other.cancel()
            self._finish(reason, error)
            return
        if all(other.done for other in self.states):
            reasons = {other.end_reason for other in self.states}
            overall = (
                FinishReason.CANCELLED if FinishReason.CANCELLED in reasons else self.states[0].end_reason
            )
            self._finish(overall or reason, error)

    def _finish(self, reason: FinishReason, error: str) -> None:
        if self.done:
            return
        self.done = True
        usage = Usage(self.prompt_tokens, sum(len(state.tokens) for state in self.states))
        ends = tuple(
            ChoiceEnd(state.choice, state.end_reason or FinishReason.CANCELLED, len(state.tokens))
            for state in self.states
        )
        self.events.put_nowait(
            GenerationEnd(self.request_id, self._sequence, reason, usage, error, choices=ends)
        )


class _Queued(Protocol):
    request_id: str
    done: bool
    events: asyncio.Queue[GenerationEvent]


class QueuedGeneration:
    """Async iterator over the events a generation queues (`state.events`), up to and including
    its `GenerationEnd`; leaving it early (`aclose`, the `async with` block) stops the
    generation (`_stop`). The engines' streams differ only in how they stop one."""

    def __init__(self, state: _Queued) -> None:
        self._queued = state
        self._finished = False

    @property
    def request_id(self) -> str:
        return self._queued.request_id

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> GenerationEvent:
        if self._finished:
            raise StopAsyncIteration
        event = await self._queued.events.get()
        self._finished = isinstance(event, GenerationEnd)
        return event

    def ready(self) -> list[GenerationEvent]:
        """Every event already queued, without waiting: chunks of one loop turn travel together."""
        out: list[GenerationEvent] = []
        while not self._finished and not self._queued.events.empty():
            event = self._queued.events.get_nowait()
            out.append(event)
            self._finished = isinstance(event, GenerationEnd)
        return out

    async def aclose(self) -> None:
        if not self._queued.done:
            self._stop()

    def _stop(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class GenerationStream(QueuedGeneration):
    """Async iterator over one generation's events; leaving it early cancels the generation.

    stream = await engine.submit(request)
    async with stream:
        async for event in stream: ...
    """

    def __init__(self, state: StreamState | ChoiceGroup, cancel: Callable[[str], bool]) -> None:
        super().__init__(state)
        self._state = state
        self._cancel = cancel

    @property
    def prompt_tokens(self) -> int:
        return self._state.prompt_tokens

    def _stop(self) -> None:
        self._state.cancel()
