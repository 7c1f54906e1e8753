"""KServe text_input -> text_output on a generative model (gateway/kserve_generative.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import numpy as np
import pytest

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.common.tensors import decode_tensors, encode_tensors
from loadmaster.gateway.calls import InferenceCall
from loadmaster.gateway.catalog import ModelView
from loadmaster.gateway.generation import Finished, GenerationEvent, GenerationRequest, TextChunk
from loadmaster.gateway.kserve_generative import GenerativeKServe, with_generative_tensors
from loadmaster.v1 import model_pool_pb2, tensor_pb2

MODELS = {
    "chat": ModelView("chat", "READY", backend="transformers"),
    "double": ModelView("double", "READY", backend="python"),
}


class Generations:
    def __init__(self) -> None:
        self.requests: list[GenerationRequest] = []

    async def generate(
        self, request: GenerationRequest, *, request_id: str, client_id: str, tenant: str = ""
    ) -> AsyncIterator[GenerationEvent]:
        self.requests.append(request)
        for word in ("once ", "upon"):
            yield TextChunk(word)
        yield Finished("length", 3, 2)


class Catalog:
    def __init__(self) -> None:
        self.lookups = 0

    async def models(self) -> Mapping[str, ModelView]:
        self.lookups += 1
        return MODELS


def call(model: str, arrays: dict[str, Any]) -> InferenceCall:
    descriptors, payload = encode_tensors(arrays)
    return InferenceCall("r-1", "c-1", model, descriptors, payload, priority=2, timeout_ms=500.0)


def bridge() -> tuple[GenerativeKServe, Generations, Catalog]:
    generations, catalog = Generations(), Catalog()
    return GenerativeKServe(generations, catalog.models), generations, catalog


async def test_text_input_for_a_language_model_is_a_generation() -> None:
    kserve, generations, _ = bridge()
    text = call(
        "chat", {"text_input": np.array([b"hi"], dtype=object), "max_tokens": np.array([7], np.int32)}
    )
    assert await kserve.handles(text)
    result = await kserve.infer(text)
    assert decode_tensors(result.outputs, result.payload)["text_output"].tolist() == [b"once upon"]
    (request,) = generations.requests
    assert (request.prompt, request.max_tokens, request.temperature) == ("hi", 7, 0.0)  # greedy by default
    assert (request.priority, request.deadline_ms, request.client_id) == (2, 500.0, "c-1")


async def test_tensor_calls_never_look_the_model_up() -> None:
    kserve, _, catalog = bridge()
    assert not await kserve.handles(call("double", {"x": np.zeros(3, np.float32)}))
    assert catalog.lookups == 0  # the tensor path pays nothing
    assert not await kserve.handles(call("double", {"text_input": np.array([b"hi"], dtype=object)}))


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"text_input": np.array([b"a", b"b"], dtype=object)}, "one prompt per request"),
        (
            {"text_input": np.array([b"hi"], dtype=object), "other": np.zeros(1)},
            "tensor 'other' is not an input",
        ),
        ({"text_input": np.array([b"\xff"], dtype=object)}, "not UTF-8"),
        (
            {"text_input": np.array([b"hi"], dtype=object), "temperature": np.array([9.0], np.float32)},
            "tensor 'temperature': 9",
        ),
        (
            {"text_input": np.array([b"hi"], dtype=object), "max_tokens": np.array([0], np.int32)},
            "max_tokens",
        ),
    ],
)
async def test_bad_text_calls_name_the_tensor(arrays: dict[str, Any], message: str) -> None:
    kserve, generations, _ = bridge()
    with pytest.raises(InvalidArgumentError, match=message):
        await kserve.infer(call("chat", arrays))
    assert generations.requests == []


def test_language_models_without_declared_tensors_describe_text_tensors() -> None:
    empty = model_pool_pb2.ModelSignature(model_id="chat")
    described = with_generative_tensors(MODELS["chat"], empty)
    assert [t.name for t in described.inputs] == ["text_input", "max_tokens", "temperature"]
    assert [(t.name, t.dtype) for t in described.outputs] == [("text_output", tensor_pb2.DTYPE_BYTES)]
    assert with_generative_tensors(MODELS["double"], empty) is empty  # tensor models: as declared
