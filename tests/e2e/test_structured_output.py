"""Structured output through the real suite (gateway -> scheduler -> model-pool worker ->
transformers engine with llguidance) with the official `openai` client and the random-weight
`tiny-chat`: `response_format` json_schema and json_object, streamed and not, the client's own
`parse` with a pydantic model, a schema the library cannot compile (400 naming it), replies at
small budgets that still end complete, valid and finite (issue 34), and a max_tokens no valid
reply fits in (400 naming max_tokens, streamed or not)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from loadmaster.cli.launcher import Suite

MODEL = "tiny-chat"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


def person_format(schema: Any = PERSON) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


SPEED = {  # issue 34's schema
    "type": "object",
    "properties": {"speed": {"type": "number"}, "mode": {"enum": ["walk", "run"]}},
    "required": ["speed", "mode"],
    "additionalProperties": False,
}


class Ticket(BaseModel):
    title: str = Field(max_length=20)
    priority: int = Field(ge=0, le=3)
    state: Literal["open", "closed"]


@pytest.fixture(scope="module")
def base_url(suite: Suite) -> Iterator[str]:
    gateway = suite.settings.gateway
    yield f"http://{gateway.http_host}:{gateway.http_port}/v1"


@pytest.fixture()
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)


def chat(text: str) -> list[Any]:
    return [{"role": "system", "content": "answer in JSON"}, {"role": "user", "content": text}]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_json_schema_reply_parses_and_validates(client: openai.OpenAI, temperature: float) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=chat("who are you?"),
        max_tokens=200,
        temperature=temperature,
        seed=3,
        response_format=person_format(),  # type: ignore[arg-type]
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


def test_a_streamed_json_schema_reply_parses_and_validates(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=chat("stream it"),
        max_tokens=200,
        temperature=1.0,
        seed=5,
        stream=True,
        response_format=person_format(),  # type: ignore[arg-type]
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_mode_answers_an_object(client: openai.OpenAI) -> None:
    """Text completions take `response_format` too (as an extra field: the client's
    `completions.create` has no parameter for it). json_object bounds nothing (keys and
    strings may run on), but the budget closes the object in time: every reply stops."""
    replies = [
        client.completions.create(
            model=MODEL,
            prompt="hello",
            max_tokens=100,
            temperature=1.0,
            seed=seed,
            extra_body={"response_format": {"type": "json_object"}},
        ).choices[0]
        for seed in range(8)
    ]
    for choice in replies:
        assert choice.finish_reason == "stop", choice
        assert isinstance(json.loads(choice.text), dict)


def _finite(value: Any) -> bool:
    if isinstance(value, dict):
        return all(_finite(item) for item in value.values())
    if isinstance(value, list):
        return all(_finite(item) for item in value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return True
    return abs(value) < 2**1023 and math.isfinite(float(value))


@pytest.mark.parametrize(
    ("kind", "max_tokens"), [("json_schema", 64), ("json_schema", 40), ("json_object", 16)]
)
def test_small_budgets_still_end_complete_valid_and_finite(
    client: openai.OpenAI, kind: str, max_tokens: int
) -> None:
    """Issue 34's cases through the suite: `{speed: number, mode: walk|run}` at max_tokens 64
    and 40 and json_object at 16, sampled at temperature 1 with six seeds: every reply stops
    with a value that parses, validates and has only finite numbers."""
    response_format: Any = person_format(SPEED) if kind == "json_schema" else {"type": "json_object"}
    for seed in range(6):
        choice = client.chat.completions.create(
            model=MODEL,
            messages=chat("how fast?"),
            max_tokens=max_tokens,
            temperature=1.0,
            seed=seed,
            response_format=response_format,
        ).choices[0]
        assert choice.finish_reason == "stop", choice
        value = json.loads(choice.message.content or "")
        if kind == "json_schema":
            jsonschema.validate(value, SPEED)
        assert isinstance(value, dict) and _finite(value)


def test_the_clients_parse_fills_a_pydantic_model(client: openai.OpenAI) -> None:
    reply = client.chat.completions.parse(
        model=MODEL,
        messages=chat("a ticket"),
        max_tokens=200,
        temperature=1.0,
        seed=11,
        response_format=Ticket,
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Ticket) and 0 <= parsed.priority <= 3


@pytest.mark.parametrize(
    ("schema", "needle"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "string", "pattern": "(a"}, "unclosed group"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/gone"}}}, "does not exist"),
    ],
)
def test_a_schema_the_library_cannot_compile_is_a_400_naming_it(
    client: openai.OpenAI, base_url: str, schema: Any, needle: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=chat("x"), max_tokens=8, response_format=person_format(schema)
        )
    assert caught.value.status_code == 400
    assert needle in caught.value.message and "response_format.json_schema.schema" in caught.value.message
    body = {"model": MODEL, "messages": chat("x"), "max_tokens": 8, "stream": True}
    body["response_format"] = person_format(schema)
    with httpx.stream("POST", base_url + "/chat/completions", json=body, timeout=60) as streamed:
        assert streamed.status_code == 400  # streamed too: refused before the first byte
        assert needle in json.loads(streamed.read())["error"]["message"]
    ok = client.chat.completions.create(  # and the worker keeps serving
        model=MODEL, messages=chat("y"), max_tokens=200, temperature=0, response_format=person_format()
    )
    jsonschema.validate(json.loads(ok.choices[0].message.content or ""), PERSON)


def test_a_malformed_response_format_is_a_400_from_the_gateway(base_url: str) -> None:
    body = {"model": MODEL, "messages": chat("x"), "response_format": {"type": "json_schema"}}
    reply = httpx.post(base_url + "/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "response_format"


def test_a_max_tokens_no_valid_reply_fits_in_is_a_400_naming_it(client: openai.OpenAI, base_url: str) -> None:
    """PERSON's shortest reply takes more than 4 tokens: the worker refuses it before it is
    queued, and the gateway answers 400 with `param: max_tokens`, streamed too (before the
    first byte); the worker keeps serving."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=chat("x"), max_tokens=4, temperature=0, response_format=person_format()
        )
    assert caught.value.status_code == 400
    body: Any = caught.value.body
    assert body["param"] == "max_tokens" and body["message"].startswith("max_tokens: 4 is too small"), body
    request = {"model": MODEL, "messages": chat("x"), "max_tokens": 4, "stream": True}
    request["response_format"] = person_format()
    with httpx.stream("POST", base_url + "/chat/completions", json=request, timeout=60) as streamed:
        assert streamed.status_code == 400
        error = json.loads(streamed.read())["error"]
        assert error["param"] == "max_tokens" and "max_tokens" in error["message"]
    ok = client.chat.completions.create(
        model=MODEL, messages=chat("y"), max_tokens=40, temperature=0, response_format=person_format()
    )
    assert ok.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(ok.choices[0].message.content or ""), PERSON)
