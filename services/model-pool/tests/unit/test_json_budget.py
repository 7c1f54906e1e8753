"""The token budget of structured output, without the model: bounded numbers (`_json_bounds`),
the schema's lower bound (`_json_shape`), the shortest-closing search (`_json_closing`) and the
budget's decisions (`_json_budget`), on llguidance with tiny-chat's real tokenizer.

The walks stand in for a model: at each step a random token the grammar allows, which the
budget may replace (`approve`) or dictate (`forced`), as the engine's processors do. The
engine itself, with the model, is tested in test_structured_output.py. About 15 s.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import llguidance.hf
import pytest
from random_schemas import random_schemas, shortest_bytes  # tests/unit/random_schemas.py
from transformers import AutoTokenizer

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.model_pool.engines import _json_closing, grammar
from loadmaster.model_pool.engines._json_bounds import NUMBER_LIMIT, bounded_object, bounded_schema
from loadmaster.model_pool.engines._json_budget import Budget, Vocabulary, _utf8_rest
from loadmaster.model_pool.engines._json_closing import BYTE_TOKENIZER, Closer
from loadmaster.model_pool.engines._json_shape import SchemaIndex, Shape
from loadmaster.model_pool.generation import ResponseFormat

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
OPTIONS: Any = {"whitespace_flexible": False}
SPEED = {  # issue 34's schema
    "type": "object",
    "properties": {"speed": {"type": "number"}, "mode": {"enum": ["walk", "run"]}},
    "required": ["speed", "mode"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    spec = importlib.util.spec_from_file_location("_lm_make_models_budget", EXAMPLES / "make_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    weights = module.build_tiny_chat(tmp_path_factory.mktemp("tiny-chat-tokenizer"))
    yield AutoTokenizer.from_pretrained(weights.parent, local_files_only=True)


@pytest.fixture(scope="module")
def grammars(hf_tokenizer: Any) -> grammar.JsonGrammars:
    return grammar.JsonGrammars(
        hf_tokenizer, vocab_size=len(hf_tokenizer), eos_ids=[hf_tokenizer.eos_token_id]
    )


def compiled(schema: Any) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=OPTIONS)


def accepts(schema: Any, text: str) -> bool:
    matcher = llguidance.LLMatcher(BYTE_TOKENIZER, compiled(schema), log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def finite(value: Any) -> bool:
    if isinstance(value, dict):
        return all(finite(item) for item in value.values())
    if isinstance(value, list):
        return all(finite(item) for item in value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return True
    return abs(value) < 2**1023 and math.isfinite(float(value))


# ---- numbers a double holds ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "held"),
    [
        ('{"speed":1.5,"mode":"run"}', True),
        ('{"speed":-0.125,"mode":"walk"}', True),
        ('{"speed":999999999999998.75,"mode":"run"}', True),
        ('{"speed":128.71482e327550309123232,"mode":"run"}', False),  # issue 34's infinity
        ('{"speed":1e5,"mode":"run"}', False),
        ('{"speed":1234567890123456,"mode":"run"}', False),
    ],
)
def test_a_bounded_schema_admits_only_finite_numbers(text: str, held: bool) -> None:
    assert accepts(SPEED, text)  # llguidance's own grammar admits them all
    assert accepts(bounded_schema(SPEED), text) is held


def test_json_object_and_any_value_places_get_bounded_numbers() -> None:
    anything = bounded_object()
    assert accepts(anything, '{"a":[1.5,{"b":null,"c":"x"}],"d":true}')
    assert not accepts(anything, '{"a":1e400}') and not accepts(anything, '{"a":[{"b":2E9}]}')
    assert not accepts(anything, "[]")  # still an object
    open_object = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert accepts(open_object, '{"a":1,"b":{"c":1e400}}')  # extra properties admit anything
    assert accepts(bounded_schema(open_object), '{"a":1,"b":{"c":[2.5]}}')
    assert not accepts(bounded_schema(open_object), '{"a":1,"b":{"c":1e400}}')
    assert not accepts(bounded_schema(True), "1e400") and accepts(bounded_schema(True), '"x"')


def test_bounding_keeps_the_schemas_own_limits_and_everything_else() -> None:
    schema = {"type": "integer", "minimum": 5, "description": "d"}
    bounded = bounded_schema(schema)
    assert (bounded["minimum"], bounded["maximum"]) == (5, NUMBER_LIMIT) and schema == {
        "type": "integer", "minimum": 5, "description": "d"
    }  # fmt: skip
    assert accepts(bounded_schema({"format": "date-time", "type": "string"}), '"2020-01-01T00:00:00Z"')
    assert not accepts(bounded_schema({"type": "string", "format": "date-time"}), '"x"')
    for original in random_schemas(50, seed=5):  # closed, bounded schemas: only the $defs entry
        bounded = bounded_schema(original)
        del bounded["$defs"]
        assert bounded == original


# ---- the shortest closing path ---------------------------------------------------------------


@pytest.mark.parametrize("seed", [22, 7])
def test_the_search_finds_the_shortest_value_of_every_random_schema(seed: int) -> None:
    """The A* search with the schema's lower bound returns a shortest value, byte for byte,
    for 200 random schemas (optional keys left out, the shortest enum member, integer range
    and pattern match), and the grammar accepts it."""
    for schema in random_schemas(200, seed=seed):
        bounded = bounded_schema(schema)
        assert Shape(SchemaIndex(bounded)).bound() == shortest_bytes(schema), schema
        found = Closer(compiled(bounded), bounded).closing(limit=4096)
        assert found is not None and found[1], schema  # found by A*, not by the fallback dive
        closing = found[0]
        assert len(closing) == shortest_bytes(schema), (schema, closing)
        jsonschema.validate(json.loads(closing), schema)
        assert accepts(bounded, closing.decode())


@pytest.mark.parametrize(
    ("schema", "prefix", "closing"),
    [
        ({"type": "object", "minProperties": 2}, "", '{"":0,"a":0}'),  # not the same key twice
        ({"type": "number", "minimum": 0.5}, "", "1"),
        ({"type": "string", "format": "email"}, "", '"a@a"'),
        ({"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}, '"ab', '@a.com"'),
        ({"type": "integer", "minimum": 25, "maximum": 687}, "", "25"),
        ({"enum": [None, "open"]}, "", "null"),
        ({"type": "string", "pattern": "^[0-9]{3}-[0-9]{2}$"}, '"12', '0-00"'),
        (SPEED, '{"speed":12', ',"mode":"run"}'),
        (SPEED, '{"speed":12.', '0,"mode":"run"}'),
        (SPEED, '{"speed":1,"mode":"wa', 'lk"}'),
        ({"type": "array", "items": {"type": "string"}, "minItems": 2}, '["a\\', 'n",""]'),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "string"}, "bb": {"type": "integer"}},
                "required": ["bb"],
                "additionalProperties": False,
            },
            "{",
            '"bb":0}',
        ),
    ],
)
def test_closing_paths(schema: Any, prefix: str, closing: str) -> None:
    bounded = bounded_schema(schema)
    closer = Closer(compiled(bounded), bounded)
    assert closer.feed(prefix.encode())
    assert closer.closing(limit=4096) == (closing.encode(), True)


def test_when_a_star_gives_up_a_dive_still_finds_a_valid_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """With too few expansions for A* (here 5; real searches get 3,000), the depth-first
    dive returns a valid path, marked as maybe not the shortest."""
    schema = {
        "type": "object",
        "properties": {
            "when": {"type": "string", "format": "date-time"},
            "to": {"type": "string", "format": "email"},
        },
        "required": ["when", "to"],
    }
    bounded = bounded_schema(schema)
    monkeypatch.setattr(_json_closing, "_SEARCH_NODES", 5)
    found = Closer(compiled(bounded), bounded).closing(limit=4096)
    assert found is not None and not found[1]
    jsonschema.validate(json.loads(found[0]), schema)
    assert accepts(bounded, found[0].decode())


def test_a_cut_character_is_finished_first() -> None:
    closer = Closer(compiled(bounded_schema({"type": "string"})), {"type": "string"})
    assert closer.feed('"\u20ac'.encode()[:3])  # the euro sign, its last byte missing
    assert closer.closing(limit=64) == (b'\x80"', True)
    cut = (b"ab", b"\xe2", b"\xe0", b"\xe2\x82", b"\xf0", b"\xc3\xa9")
    assert [_utf8_rest(data) for data in cut] == [
        b"",
        b"\x80\x80",
        b"\xa0\x80",
        b"\x80",
        b"\x90\x80\x80",
        b"",
    ]
    assert all((data + _utf8_rest(data)).decode() for data in cut)


def test_the_schema_bound_never_exceeds_the_closing_left(hf_tokenizer: Any) -> None:
    """Along random walks the lower bound stays at or below the closing the search finds
    (A* needs an admissible heuristic to return a shortest path)."""
    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=len(hf_tokenizer))
    vocabulary = Vocabulary(tokenizer, eos_ids=[hf_tokenizer.eos_token_id])
    rng = random.Random(3)
    for schema in random_schemas(40, seed=11):
        bounded = bounded_schema(schema)
        text = compiled(bounded)
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)
        closer = Closer(text, bounded)
        for _ in range(30):
            found = closer.closing(limit=4096)
            assert found is not None and found[1]
            assert closer._shape.bound() <= len(found[0]), (schema, closer._text, found)
            allowed = _allowed_tokens(matcher)
            token = rng.choice(allowed)
            if token == hf_tokenizer.eos_token_id:
                break
            assert matcher.consume_token(token) and closer.feed(vocabulary.bytes_of(token))


def _allowed_tokens(matcher: Any) -> list[int]:
    mask = matcher.compute_bitmask()
    return [index for index in range(len(mask) * 8) if mask[index >> 3] >> (index & 7) & 1]


# ---- the budget ------------------------------------------------------------------------------


def _walk(
    grammars: grammar.JsonGrammars, schema: Any, max_tokens: int, rng: random.Random
) -> tuple[str, int, Budget]:
    """A model that picks uniformly among allowed tokens, with the budget applied the way
    the engine's processors apply it; checks `need <= remaining` before every step."""
    response_format = ResponseFormat("json_schema", json.dumps(schema))
    constraint = grammars.constraint(response_format, max_tokens=max_tokens)
    budget = constraint.budget
    assert budget is not None and budget.plan is not None
    vocabulary = grammars.vocabulary()
    generated: list[int] = []
    while len(generated) < max_tokens:
        remaining = max_tokens - len(generated)
        assert budget.plan is not None and budget.plan.need <= remaining, (schema, generated)
        token = budget.forced(remaining)
        if token is None:
            token = budget.approve(rng.choice(_allowed_tokens(constraint.matcher)), remaining)
        if token in vocabulary.eos_ids:
            break
        assert constraint.matcher.consume_token(token), vocabulary.bytes_of(token)
        budget.feed(token)
        generated.append(token)
    else:
        raise AssertionError(f"no end of sequence within {max_tokens} tokens: {generated}")
    text = b"".join(vocabulary.bytes_of(token) for token in generated).decode()
    return text, len(generated) + 1, budget


@pytest.mark.parametrize("max_tokens", [64, 40, 24])
def test_every_walk_ends_with_a_complete_valid_finite_value(
    grammars: grammar.JsonGrammars, max_tokens: int
) -> None:
    """Random tokens under the grammar and the budget: every walk ends with end-of-sequence
    inside max_tokens and its text parses, validates against the original schema and is
    finite; a schema whose shortest value does not fit is refused, and only then."""
    rng = random.Random(max_tokens)
    refused = 0
    for schema in [SPEED, *random_schemas(80, seed=31)]:
        try:
            text, used, _ = _walk(grammars, schema, max_tokens, rng)
        except InvalidArgumentError as error:
            assert str(error).startswith(f"max_tokens: {max_tokens} is too small"), error
            assert shortest_bytes(schema) + 1 > max_tokens  # the token count is never above it
            refused += 1
            continue
        value = json.loads(text)
        jsonschema.validate(value, schema)
        assert finite(value) and used <= max_tokens
    assert refused < 40


def test_a_budget_of_exactly_the_shortest_reply_is_followed_to_the_letter(
    grammars: grammar.JsonGrammars,
) -> None:
    for schema in (SPEED, *random_schemas(20, seed=2)):
        response_format = ResponseFormat("json_schema", json.dumps(schema))
        need = grammars.constraint(response_format, max_tokens=4096).budget.plan.need  # type: ignore[union-attr]
        text, used, _ = _walk(grammars, schema, need, random.Random(1))
        assert used == need and len(text) == shortest_bytes(schema)
        jsonschema.validate(json.loads(text), schema)
        with pytest.raises(InvalidArgumentError, match=r"^max_tokens: "):
            grammars.constraint(response_format, max_tokens=need - 1)


def test_most_steps_need_no_search(grammars: grammar.JsonGrammars) -> None:
    """The old closing path, or a suffix of it, settles almost every sampled token; a fresh
    search is the exception (the bench measures the cost)."""
    rng = random.Random(9)
    steps = searches = 0
    for schema in random_schemas(30, seed=8):
        _, used, budget = _walk(grammars, schema, 200, rng)
        steps += used
        searches += budget.searches
    assert searches < 0.2 * steps, (searches, steps)


def test_the_shortest_reply_is_searched_once_per_schema(grammars: grammar.JsonGrammars) -> None:
    response_format = ResponseFormat("json_schema", json.dumps({"type": "array", "minItems": 3}))
    first = grammars.constraint(response_format, max_tokens=64).budget
    again = grammars.constraint(response_format, max_tokens=64).budget
    assert first is not None and again is not None
    assert (first.searches, again.searches) == (1, 0)
    assert (
        first.plan is not None and again.plan is not None and first.plan.text == again.plan.text == b"[0,0,0]"
    )


def test_json_object_fits_in_two_tokens(grammars: grammar.JsonGrammars) -> None:
    constraint = grammars.constraint(ResponseFormat("json_object"), max_tokens=16)
    assert constraint.budget is not None and constraint.budget.plan is not None
    assert constraint.budget.plan.text == b"{}" and constraint.budget.plan.need <= 3
    with pytest.raises(InvalidArgumentError, match=r"^max_tokens: 1 is too small"):
        grammars.constraint(ResponseFormat("json_object"), max_tokens=1)
    assert grammars.constraint(ResponseFormat("json_object")).budget is None  # no max_tokens: unplanned


def test_a_failing_budget_is_dropped_not_the_managers_thread(
    grammars: grammar.JsonGrammars, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The budget runs inside the manager's batch step: an error there (a bug of ours) must
    not stop batching. The sequence goes on under its grammar alone."""
    constraint = grammars.constraint(ResponseFormat("json_schema", json.dumps(SPEED)), max_tokens=40)
    assert constraint.budget is not None

    def broken(*_: Any) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(Budget, "approve", broken)
    assert constraint.approve(123, 40) == 123  # the sampled token stands
    assert constraint.budget is None and "the token budget failed" in caplog.text
    assert constraint.forced(1) is None  # no budget, no forcing
