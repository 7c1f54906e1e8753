"""Generation streams at the wire: protobuf <-> domain values, and the stream-order checker.

    request_from_proto(GenerateRequest)         -> GenerationRequest (checked: fields named)
    reply_to_proto(event, model_id=..., ...)    -> GenerateReply (chunk / result / error / cancelled)
    StreamOrder().accept(reply)                 -> raises StreamOrderError on a gap, a repeat or
                                                   anything after the terminal

The data port and the gateway use these so both sides speak the contract written in
model_pool.proto and docs/generative.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from loadmaster.common.errors import InternalError, InvalidArgumentError
from loadmaster.model_pool.generation import (
    ChatMessage,
    FinishReason,
    FunctionTool,
    GenerationEnd,
    GenerationEvent,
    GenerationRequest,
    ResponseFormat,
    SamplingParams,
    TokenLogprob,
    ToolCall,
    ToolChoice,
    ToolUse,
)
from loadmaster.v1 import errors_pb2, model_pool_pb2

__all__ = ["StreamOrder", "StreamOrderError", "reply_to_proto", "request_from_proto", "tool_call_to_proto"]

_FINISH = {
    FinishReason.STOP: model_pool_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: model_pool_pb2.FINISH_REASON_LENGTH,
    FinishReason.TOOL_CALLS: model_pool_pb2.FINISH_REASON_TOOL_CALLS,
}
_TOOL_CHOICES = {choice.value: choice for choice in ToolChoice}


class StreamOrderError(InternalError):
    """A stream broke its contract: a gap, a repeat, or a reply after the terminal."""


def request_from_proto(message: model_pool_pb2.GenerateRequest) -> GenerationRequest:
    sampling = message.sampling
    params = SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature if sampling.HasField("temperature") else 1.0,
        top_p=sampling.top_p if sampling.HasField("top_p") else 1.0,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=tuple(sampling.stop),
    )
    kind = message.WhichOneof("prompt")
    if kind is None:
        raise InvalidArgumentError("give one of prompt_token_ids, prompt_text or messages")
    request = GenerationRequest(
        request_id=message.request_id,
        params=params,
        prompt_token_ids=tuple(message.prompt_token_ids.ids) if kind == "prompt_token_ids" else None,
        prompt=message.prompt_text if kind == "prompt_text" else None,
        messages=tuple(_message(m) for m in message.messages.messages) if kind == "messages" else None,
        response_format=_response_format(message),
        priority=message.priority,
        tenant=message.tenant,
        tenant_weight=message.tenant_weight if message.tenant_weight > 0 else 1.0,
        chat_template_kwargs=_template_kwargs(message),
        tools=_tools(message),
        logprobs=message.logprobs.top if message.logprobs.enabled else None,
        n=max(1, message.n),
    )
    request.check()
    return request


def _template_kwargs(message: model_pool_pb2.GenerateRequest) -> dict[str, Any] | None:
    if not message.chat_template_kwargs:
        return None
    try:
        value = json.loads(message.chat_template_kwargs)
    except ValueError as error:
        raise InvalidArgumentError(f"chat_template_kwargs: not JSON ({error})") from None
    if not isinstance(value, dict):
        raise InvalidArgumentError("chat_template_kwargs: a JSON object is required")
    return value


def _message(wire: model_pool_pb2.ChatMessage) -> ChatMessage:
    return ChatMessage(
        wire.role,
        wire.content,
        tool_calls=tuple(_call(call) for call in wire.tool_calls),
        tool_call_id=wire.tool_call_id,
        name=wire.name,
        images=tuple(wire.images),
    )


def _call(wire: model_pool_pb2.ToolCall) -> ToolCall:
    return ToolCall(id=wire.id, name=wire.name, arguments=wire.arguments, index=wire.index)


def _tools(message: model_pool_pb2.GenerateRequest) -> ToolUse | None:
    if not message.HasField("tools"):
        return None
    wire = message.tools
    choice = _TOOL_CHOICES.get(wire.choice or "auto")
    if choice is None:
        raise InvalidArgumentError(
            f"tool_choice: {wire.choice!r} is not one of auto, none, required, function"
        )
    return ToolUse(
        functions=tuple(
            FunctionTool(f.name, description=f.description, parameters=f.parameters_json, strict=f.strict)
            for f in wire.functions
        ),
        choice=choice,
        function_name=wire.function_name,
        parallel=wire.parallel,
    )


def tool_call_to_proto(call: ToolCall) -> model_pool_pb2.ToolCall:
    return model_pool_pb2.ToolCall(id=call.id, name=call.name, arguments=call.arguments, index=call.index)


def _logprob_to_proto(item: TokenLogprob) -> model_pool_pb2.TokenLogprob:
    return model_pool_pb2.TokenLogprob(
        token_id=item.token_id,
        token=item.token,
        logprob=item.logprob,
        top=[
            model_pool_pb2.TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob) for t in item.top
        ],
    )


def _response_format(message: model_pool_pb2.GenerateRequest) -> ResponseFormat | None:
    if not message.HasField("response_format") or message.response_format.type in ("", "text"):
        return None
    wire = message.response_format
    return ResponseFormat(kind=wire.type, schema=wire.json_schema, name=wire.name)


def reply_to_proto(
    event: GenerationEvent,
    *,
    model_id: str,
    worker_id: str = "",
    generation: int = 0,
    error_code: int = errors_pb2.ERROR_CODE_INTERNAL,
    retryable: bool = False,
) -> model_pool_pb2.GenerateReply:
    reply = model_pool_pb2.GenerateReply(
        request_id=event.request_id,
        model_id=model_id,
        sequence=event.sequence,
        worker_id=worker_id,
        generation=generation,
    )
    if not isinstance(event, GenerationEnd):
        reply.chunk.token_ids.extend(event.token_ids)
        reply.chunk.text = event.text
        reply.chunk.choice = event.choice
        if event.logprobs:
            reply.chunk.logprobs.extend(_logprob_to_proto(item) for item in event.logprobs)
        if event.tool_calls:
            reply.chunk.tool_calls.extend(tool_call_to_proto(call) for call in event.tool_calls)
        return reply
    usage = model_pool_pb2.GenerationUsage(
        prompt_tokens=event.usage.prompt_tokens, completion_tokens=event.usage.completion_tokens
    )
    if event.finish_reason is FinishReason.CANCELLED:
        reply.cancelled.usage.CopyFrom(usage)
        reply.cancelled.reason = event.error
    elif event.finish_reason is FinishReason.ERROR:
        reply.error.error_code = error_code  # type: ignore[assignment]
        reply.error.error_message = event.error
        reply.error.retryable = retryable and event.sequence == 0  # never once a chunk went out
        reply.error.usage.CopyFrom(usage)
    else:
        reply.result.finish_reason = _FINISH[event.finish_reason]
        reply.result.usage.CopyFrom(usage)
        reply.result.choices.extend(
            model_pool_pb2.ChoiceEnd(
                index=end.index,
                finish_reason=_FINISH.get(end.finish_reason, model_pool_pb2.FINISH_REASON_STOP),
                completion_tokens=end.completion_tokens,
            )
            for end in event.choices
        )
    return reply


@dataclass(slots=True)
class StreamOrder:
    """Checks one request's replies: sequence 0, 1, 2, ... then one terminal, then nothing.
    A `progress` reply (a waiting stream's place) is outside that order: it is only checked
    not to follow a chunk or the terminal."""

    expected: int = 0
    finished: bool = False

    def accept(self, reply: model_pool_pb2.GenerateReply) -> bool:
        """True when `reply` is the terminal; raise `StreamOrderError` when the order is broken."""
        if reply.WhichOneof("kind") == "progress":
            if self.expected or self.finished:
                raise StreamOrderError(f"request {reply.request_id}: progress after the stream began")
            return False
        if self.finished:
            raise StreamOrderError(f"request {reply.request_id}: reply {reply.sequence} after the terminal")
        if reply.sequence != self.expected:
            what = "repeated" if reply.sequence < self.expected else "missing"
            raise StreamOrderError(
                f"request {reply.request_id}: got reply {reply.sequence}, expected {self.expected} "
                f"({what} replies)"
            )
        kind = reply.WhichOneof("kind")
        if kind is None:
            raise StreamOrderError(f"request {reply.request_id}: reply {reply.sequence} carries nothing")
        self.expected += 1
        self.finished = kind != "chunk"
        return self.finished
