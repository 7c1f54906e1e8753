"""`/v1/embeddings` bodies and replies: every `input` form, the 400s naming the field, and
replies (float and base64) that validate as the official `openai` package's types."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from openai.types import CreateEmbeddingResponse

from loadmaster.gateway.embeddings import EmbeddingResult
from loadmaster.gateway.frontends.openai_embeddings import MAX_INPUTS, parse_embeddings, render_embeddings
from loadmaster.gateway.frontends.openai_schema import OpenAIError


def body(**fields: object) -> bytes:
    return json.dumps({"model": "tiny-embed", **fields}).encode()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("one text", ("one text",)),
        (["a", "b"], ("a", "b")),
        ([5, 6, 7], ((5, 6, 7),)),
        ([[5, 6], [7]], ((5, 6), (7,))),
    ],
)
def test_every_input_form_becomes_a_tuple_of_inputs(value: object, expected: tuple[object, ...]) -> None:
    request, base64_vectors = parse_embeddings(body(input=value, dimensions=16, x_priority=0))
    assert request.inputs == expected and request.dimensions == 16 and request.priority == 0
    assert not base64_vectors
    assert parse_embeddings(body(input="x", encoding_format="base64"))[1]


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"input": ""}, "input", "input[0]: empty"),
        ({"input": []}, "input", "at least one input"),
        ({"input": ["a", ""]}, "input", "input[1]: empty"),
        ({"input": [[1], []]}, "input", "input[1]: empty"),
        ({"input": [-1]}, "input", "token ids are integers"),
        ({"input": ["x"] * (MAX_INPUTS + 1)}, "input", f"at most {MAX_INPUTS}"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
        ({"input": "x", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
        ({}, "input", "'input' is a required property"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(fields: dict[str, object], param: str, words: str) -> None:
    with pytest.raises(OpenAIError) as caught:
        parse_embeddings(body(**fields))
    assert (caught.value.status, caught.value.param) == (400, param) and words in caught.value.message


def test_replies_in_float_and_base64_validate_and_carry_the_same_vectors() -> None:
    vectors = np.array([[0.5, -0.25, 1.0], [0.0, 2.0, -3.5]], dtype=np.float32)
    result = EmbeddingResult(vectors, (3, 4))
    plain = CreateEmbeddingResponse.model_validate_json(render_embeddings("m", result, base64_vectors=False))
    assert [d.embedding for d in plain.data] == vectors.tolist() and [d.index for d in plain.data] == [0, 1]
    assert plain.usage.prompt_tokens == plain.usage.total_tokens == 7 and plain.model == "m"
    packed = json.loads(render_embeddings("m", result, base64_vectors=True))
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in packed["data"]]
    assert np.array_equal(np.stack(decoded), vectors)
