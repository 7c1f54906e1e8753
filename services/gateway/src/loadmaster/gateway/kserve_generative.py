"""KServe v2 on a generative model: `text_input` in, `text_output` out.

Language models are served on the OpenAI API, but a generic KServe client or perf tool asks
every model for its metadata and may call ModelInfer on it. So a generative model (backend
transformers or openai_process) describes and answers the tensors that Triton's LLM backends
use:

    inputs   text_input   BYTES [1]   the prompt (a plain completion, no chat template)
             max_tokens   INT32 [1]   optional; default DEFAULT_MAX_TOKENS
             temperature  FP32  [1]   optional; default greedy (0)
    outputs  text_output  BYTES [1]   the completion

A ModelInfer that carries `text_input` for such a model runs one generation through the same
streams as the OpenAI routes (scheduler, priority, deadline); every other call goes to the
dispatcher as before, so tensor models pay nothing for this.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Protocol

import numpy as np

from loadmaster.common.backends import GENERATIVE_BACKENDS
from loadmaster.common.errors import InvalidArgumentError
from loadmaster.common.tensors import decode_tensors, encode_tensors
from loadmaster.gateway.calls import CallResult, InferenceCall
from loadmaster.gateway.catalog import ModelView
from loadmaster.gateway.dispatcher import Dispatcher
from loadmaster.gateway.generation import Finished, GenerationEvent, GenerationRequest, TextChunk
from loadmaster.gateway.generations import DEFAULT_MAX_TOKENS
from loadmaster.gateway.kserve_calls import dispatch
from loadmaster.v1 import model_pool_pb2, tensor_pb2

__all__ = ["TEXT_INPUT", "TEXT_OUTPUT", "GenerativeKServe", "with_generative_tensors"]

TEXT_INPUT = "text_input"
TEXT_OUTPUT = "text_output"
_INPUTS = (
    model_pool_pb2.TensorSpec(name=TEXT_INPUT, dtype=tensor_pb2.DTYPE_BYTES, shape=[1]),
    model_pool_pb2.TensorSpec(name="max_tokens", dtype=tensor_pb2.DTYPE_INT32, shape=[1]),
    model_pool_pb2.TensorSpec(name="temperature", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[1]),
)
_OUTPUTS = (model_pool_pb2.TensorSpec(name=TEXT_OUTPUT, dtype=tensor_pb2.DTYPE_BYTES, shape=[1]),)


class _Generations(Protocol):
    def generate(
        self, request: GenerationRequest, *, request_id: str, client_id: str
    ) -> AsyncIterator[GenerationEvent]: ...


def with_generative_tensors(
    view: ModelView, signature: model_pool_pb2.ModelSignature
) -> model_pool_pb2.ModelSignature:
    """`signature`, or for a generative model that declares no tensors, the text tensors above."""
    if view.backend not in GENERATIVE_BACKENDS or signature.inputs or signature.outputs:
        return signature
    return model_pool_pb2.ModelSignature(
        model_id=signature.model_id or view.name, backend=view.backend, inputs=_INPUTS, outputs=_OUTPUTS
    )


class GenerativeKServe:
    """Answers KServe calls that carry `text_input` for a generative model with a generation."""

    def __init__(
        self, generations: _Generations, models: Callable[[], Awaitable[Mapping[str, ModelView]]]
    ) -> None:
        self._generations = generations
        self._models = models
        self._ids = (f"kserve-gen-{n}" for n in itertools.count(1))

    async def handles(self, call: InferenceCall) -> bool:
        if not any(tensor.key == TEXT_INPUT for tensor in call.inputs):
            return False  # a tensor call: no catalog lookup on the tensor path
        view = (await self._models()).get(call.model_id)
        return view is not None and view.backend in GENERATIVE_BACKENDS

    async def answer(self, dispatcher: Dispatcher, call: InferenceCall) -> CallResult:
        """`call`'s result: a generation when it is one (`handles`), else the dispatcher's."""
        if await self.handles(call):
            return await self.infer(call)
        return await dispatch(dispatcher, call)

    async def infer(self, call: InferenceCall) -> CallResult:
        request = _request(call)
        text: list[str] = []
        model = call.model_id
        async for event in self._generations.generate(
            request, request_id=next(self._ids), client_id=call.client_id
        ):
            if isinstance(event, TextChunk):
                text.append(event.text)
            elif isinstance(event, Finished):
                model = event.model or model
        completion = np.array(["".join(text).encode()], dtype=object)
        descriptors, payload = encode_tensors({TEXT_OUTPUT: completion})
        return CallResult(request_id=call.request_id, model_id=model, outputs=descriptors, payload=payload)


def _request(call: InferenceCall) -> GenerationRequest:
    arrays = decode_tensors(call.inputs, call.payload)
    unknown = sorted(set(arrays) - {TEXT_INPUT, "max_tokens", "temperature"})
    if unknown:
        raise InvalidArgumentError(
            f"tensor '{unknown[0]}' is not an input of generative model '{call.model_id}' "
            f"(inputs: {TEXT_INPUT}, max_tokens, temperature)"
        )
    prompt = arrays[TEXT_INPUT]
    if prompt.size != 1:
        raise InvalidArgumentError(f"tensor '{TEXT_INPUT}': one prompt per request, got {prompt.size}")
    try:
        text = bytes(prompt.reshape(-1)[0]).decode()
    except UnicodeDecodeError:
        raise InvalidArgumentError(f"tensor '{TEXT_INPUT}' is not UTF-8 text") from None
    return GenerationRequest(
        model=call.model_id,
        messages=None,
        prompt=text,
        max_tokens=int(_or(_scalar(arrays, "max_tokens", int, 1, 1 << 20), DEFAULT_MAX_TOKENS)),
        temperature=_or(_scalar(arrays, "temperature", float, 0.0, 2.0), 0.0),  # greedy unless asked
        top_p=None,
        seed=None,
        stop=(),
        stream=False,
        include_usage=False,
        response_format=None,
        client_id=call.client_id,
        priority=call.priority,
        urgency=None,
        deadline_ms=call.timeout_ms or None,
        user=None,
    )


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _scalar(arrays: Mapping[str, np.ndarray], name: str, kind: type, low: float, high: float) -> float | None:
    array = arrays.get(name)
    if array is None:
        return None
    if array.size != 1 or array.dtype == object:
        raise InvalidArgumentError(f"tensor '{name}': one number, got {array.size} of {array.dtype}")
    value = kind(array.reshape(-1)[0])
    if not low <= value <= high:
        raise InvalidArgumentError(f"tensor '{name}': {value} is outside {low:g}..{high:g}")
    return value
