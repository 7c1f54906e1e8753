"""What structured output costs and whether its replies hold (tiny-chat on CPU, one torch thread).

Runs the engine in-process (no gateway), in two modes within the same run:

- `before`: the grammar mask alone, with llguidance's unbounded numbers (the engine before
  issue 34: nothing closes the value when the budget ends; the bench restores it by
  patching `grammar` for that mode);
- `after`: numbers bounded to what a double holds and the token budget (`_json_budget.py`):
  the value is steered to finish inside `max_tokens`, or the request is refused up front.

It prints and writes (bench/results/structured_output.json):

1. **Replies at small budgets**, each mode: `{speed: number, mode: walk|run}` (issue 34's
   schema) at max_tokens 64 and 40 and `json_object` at 16, temperature 1, seeds
   0..`--seeds`-1: how many parse, validate and hold only finite numbers (a 400 for a budget
   no valid reply fits counts as held; none is expected here); and the 200 random schemas of
   the property test at max_tokens 64.
2. **Grammar work per constrained token**, each mode (bring matchers up to date, fill and
   apply masks, check the sampled token against the budget: the manager thread's CPU time
   inside `GrammarMask` and `BudgetGuard`), at a roomy budget (a 12-string array schema, max_tokens 200, 16 at once)
   and a tight one (issue 34's schema at max_tokens 40, 16 at once), and fresh closing
   searches per constrained token.
3. Submit to first token of the first constrained request (llguidance converts the tokenizer
   once), a later one and a free one,
   a schema's compile time with its shortest-reply search (a new schema; a known one, whose
   shortest reply is remembered), and output tokens/s of free text against json_schema
   (each mode) at 1 and 16 concurrent sequences (equal work: free text gets the constrained
   replies' mean length as max_tokens).

    .venv/bin/python bench/structured_output.py [--rounds 3] [--seeds 10]

Needs `make models`. Timings on a shared 2-core machine are noisy: compare the two modes
of one run, not runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import torch

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.model_pool.engines import EngineContext, _json_budget, grammar
from loadmaster.model_pool.engines.transformers import TransformersEngine
from loadmaster.model_pool.generation import (
    FinishReason,
    GenerationEnd,
    GenerationRequest,
    ResponseFormat,
    SamplingParams,
    TokenChunk,
)
from loadmaster.model_pool.repository import ModelRepository

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "structured_output.json"
sys.path.insert(0, str(ROOT / "tests" / "unit"))  # random_schemas.py, shared with the tests
from random_schemas import random_schemas  # noqa: E402  (the property test's schemas)

SPEED = {  # issue 34's schema
    "type": "object",
    "properties": {"speed": {"type": "number"}, "mode": {"enum": ["walk", "run"]}},
    "required": ["speed", "mode"],
    "additionalProperties": False,
}
LONG = {
    "type": "array",
    "items": {"type": "string", "minLength": 4, "maxLength": 6},
    "minItems": 12,
    "maxItems": 12,
}
CASES = (("json_schema", SPEED, 64), ("json_schema", SPEED, 40), ("json_object", None, 16))
_ids = iter(range(1 << 30))
_spent = [0.0]  # CPU seconds inside GrammarMask and BudgetGuard
_tokens = [0]  # constrained tokens generated while timing
_searches = [0]  # fresh closing searches while timing


def _timed(method: Any) -> Any:
    """CPU time of the calling thread (the manager's), robust to other load on the machine."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.thread_time()
        try:
            return method(*args, **kwargs)
        finally:
            _spent[0] += time.thread_time() - began

    return wrapper


def _counted(method: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _searches[0] += 1
        return method(*args, **kwargs)

    return wrapper


grammar.GrammarMask.prepare_tensor_args = _timed(grammar.GrammarMask.prepare_tensor_args)  # type: ignore[method-assign]
grammar.GrammarMask.__call__ = _timed(grammar.GrammarMask.__call__)  # type: ignore[method-assign]
grammar.BudgetGuard.__call__ = _timed(grammar.BudgetGuard.__call__)  # type: ignore[method-assign]
_json_budget.Budget._search = _counted(_json_budget.Budget._search)  # type: ignore[method-assign]
_CONSTRAINT = grammar.JsonGrammars.constraint
_BOUNDED = (grammar.bounded_schema, grammar.bounded_object)


@contextlib.contextmanager
def _mode(mode: str) -> Iterator[None]:
    """`before`: unbounded numbers and no budget (the engine before issue 34); `after`: as is."""
    if mode == "after":
        yield
        return

    def unplanned(self: Any, response_format: ResponseFormat, *, max_tokens: int | None = None) -> Any:
        return _CONSTRAINT(self, response_format, max_tokens=None)

    grammar.bounded_schema = lambda schema: schema  # type: ignore[assignment]
    grammar.bounded_object = lambda: {"type": "object"}  # type: ignore[assignment]
    grammar.JsonGrammars.constraint = unplanned  # type: ignore[method-assign]
    try:
        yield
    finally:
        grammar.bounded_schema, grammar.bounded_object = _BOUNDED  # type: ignore[assignment]
        grammar.JsonGrammars.constraint = _CONSTRAINT  # type: ignore[method-assign]


def _format(kind: str, schema: Any) -> ResponseFormat:
    return ResponseFormat(kind, json.dumps(schema)) if kind == "json_schema" else ResponseFormat(kind)


async def _reply(
    engine: TransformersEngine,
    response_format: ResponseFormat | None,
    *,
    max_tokens: int,
    seed: int,
    temperature: float = 1.0,
) -> tuple[str | None, GenerationEnd | None, int]:
    """(text, terminal event, tokens); text None when the request was refused (a 400)."""
    request = GenerationRequest(
        f"b{next(_ids)}",
        SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed),
        prompt="hello",
        response_format=response_format,
    )
    text: list[str] = []
    tokens = 0
    try:
        async for event in engine.generate(request):
            if isinstance(event, TokenChunk):
                text.append(event.text)
                tokens += len(event.token_ids)
            else:
                if response_format is not None:
                    _tokens[0] += tokens
                return "".join(text), event, tokens
    except InvalidArgumentError:
        return None, None, 0
    raise AssertionError("a stream ended without a terminal event")


def _finite(value: Any) -> bool:
    if isinstance(value, dict):
        return all(_finite(item) for item in value.values())
    if isinstance(value, list):
        return all(_finite(item) for item in value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return True
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _held(text: str | None, schema: Any, kind: str) -> tuple[bool, str]:
    """Whether a reply parses, validates and is finite (a refusal holds); why not."""
    if text is None:
        return True, "refused"
    try:
        value = json.loads(text)
    except ValueError:
        return False, "does not parse"
    if kind == "json_object" and not isinstance(value, dict):
        return False, "not an object"
    if schema is not None:
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError:
            return False, "does not validate"
    if not _finite(value):
        return False, "not finite"
    return True, "ok"


async def _validity(engine: TransformersEngine, seeds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, schema, max_tokens in CASES:
        replies = await asyncio.gather(
            *(
                _reply(engine, _format(kind, schema), max_tokens=max_tokens, seed=seed)
                for seed in range(seeds)
            )
        )
        verdicts = [_held(text, schema, kind) for text, _, _ in replies]
        out[f"{kind}_{max_tokens}"] = {
            "held": sum(ok for ok, _ in verdicts),
            "of": len(verdicts),
            "refused": sum(why == "refused" for _, why in verdicts),
            "cut_or_invalid": sorted({why for ok, why in verdicts if not ok}),
            "example": next((text for text, _, _ in replies if text is not None), None),
        }
    schemas = random_schemas(200, seed=22)
    rng = random.Random(22)
    temperatures = [rng.choice([0.0, 0.7, 1.0]) for _ in schemas]
    replies = await asyncio.gather(
        *(
            _reply(engine, _format("json_schema", schema), max_tokens=64, seed=i, temperature=t)
            for i, (schema, t) in enumerate(zip(schemas, temperatures, strict=True))
        )
    )
    verdicts = [
        _held(text, schema, "json_schema") for schema, (text, _, _) in zip(schemas, replies, strict=True)
    ]
    out["random_schemas_64"] = {
        "held": sum(ok for ok, _ in verdicts),
        "of": len(verdicts),
        "refused": sum(why == "refused" for _, why in verdicts),
        "stopped": sum(end is not None and end.finish_reason is FinishReason.STOP for _, end, _ in replies),
    }
    return out


async def _grammar_cost(
    engine: TransformersEngine, *, kind: str, schema: Any, max_tokens: int
) -> dict[str, float]:
    _spent[0], _tokens[0], _searches[0] = 0.0, 0, 0
    await asyncio.gather(
        *(_reply(engine, _format(kind, schema), max_tokens=max_tokens, seed=seed) for seed in range(16))
    )
    tokens = max(1, _tokens[0])
    return {
        "us_per_token": _spent[0] / tokens * 1e6,
        "searches_per_token": _searches[0] / tokens,
        "tokens": tokens,
    }


async def _first_token_ms(engine: TransformersEngine, response_format: ResponseFormat | None) -> float:
    """Submit to first token (the first constrained request converts the tokenizer)."""
    request = GenerationRequest(
        f"b{next(_ids)}", SamplingParams(max_tokens=200, temperature=1.0, seed=0), prompt="hello",
        response_format=response_format,
    )  # fmt: skip
    began = time.perf_counter()
    first = None
    async for _event in engine.generate(request):
        if first is None:
            first = (time.perf_counter() - began) * 1e3
    assert first is not None
    return first


async def _rate(engine: TransformersEngine, *, constrained: bool, concurrency: int, max_tokens: int) -> float:
    """Output tokens/s; free text runs to `max_tokens`, constrained replies end by themselves
    (their budget is roomy: 200)."""
    began = time.perf_counter()
    replies = await asyncio.gather(
        *(
            _reply(engine, _format("json_schema", LONG), max_tokens=200, seed=i)
            if constrained
            else _reply(engine, None, max_tokens=max_tokens, seed=i)
            for i in range(concurrency)
        )
    )
    return sum(tokens for _, _, tokens in replies) / (time.perf_counter() - began)


async def main(rounds: int, seeds: int) -> dict[str, Any]:
    engine = TransformersEngine(
        ModelRepository(ROOT / "examples" / "models").spec("tiny-chat"),
        EngineContext(device="cpu", threads=1),
    )
    engine.load()
    engine.warmup()
    results: dict[str, Any] = {"seeds": seeds}
    results["first_constrained_request_ms"] = await _first_token_ms(engine, _format("json_schema", LONG))
    results["later_constrained_request_ms"] = await _first_token_ms(engine, _format("json_schema", LONG))
    results["free_request_ms"] = await _first_token_ms(engine, None)
    assert engine._grammars is not None
    for label, titled in (("new_schema", True), ("known_schema", False)):
        compile_ms = []
        for index in range(20):  # a title makes a new grammar: its shortest reply is searched
            schema = {**LONG, "title": f"t{index}"} if titled else LONG
            began = time.perf_counter()
            engine._grammars.constraint(ResponseFormat("json_schema", json.dumps(schema)), max_tokens=200)
            compile_ms.append((time.perf_counter() - began) * 1e3)
        results[f"compile_and_plan_ms_median_{label}"] = statistics.median(compile_ms)
    for mode in ("before", "after"):
        with _mode(mode):
            results[f"replies_{mode}"] = await _validity(engine, seeds)
            for budget, (kind, schema, max_tokens) in (
                ("roomy", ("json_schema", LONG, 200)),
                ("tight", ("json_schema", SPEED, 40)),
            ):
                cost = await _grammar_cost(engine, kind=kind, schema=schema, max_tokens=max_tokens)
                results[f"grammar_{budget}_{mode}"] = cost
    # Free text gets the constrained replies' mean length as max_tokens: equal work.
    probe = await asyncio.gather(
        *(_reply(engine, _format("json_schema", LONG), max_tokens=200, seed=i) for i in range(16))
    )
    max_tokens = round(statistics.mean(tokens for _, _, tokens in probe))
    results["reply_tokens"] = max_tokens
    for concurrency in (1, 16):
        for label, constrained, mode in (("free", False, "after"), ("json_schema_before", True, "before"),
                                         ("json_schema", True, "after")):  # fmt: skip
            with _mode(mode):
                rates = [
                    await _rate(
                        engine, constrained=constrained, concurrency=concurrency, max_tokens=max_tokens
                    )
                    for _ in range(rounds)
                ]
            results[f"{label}_c{concurrency}_tokens_per_s"] = statistics.median(rates)
    engine.unload()
    after = results["replies_after"]
    results["targets"] = [
        {
            "name": f"structured replies {case} held (parse, validate, finite)",
            "measured": after[case]["held"] / after[case]["of"],
            "target": 1.0,
            "unit": "fraction",
            "met": after[case]["held"] == after[case]["of"],
        }
        for case in (*(f"{kind}_{max_tokens}" for kind, _, max_tokens in CASES), "random_schemas_64")
    ]
    return results


def _print(results: dict[str, Any]) -> None:
    print(
        "submit to first token: first constrained request (tokenizer conversion, compile, search) "
        f"{results['first_constrained_request_ms']:.0f} ms, a later one {results['later_constrained_request_ms']:.1f} ms,"
        f" free text {results['free_request_ms']:.1f} ms"
    )
    print(
        "schema compile + shortest-reply search, warm engine (median of 20): "
        f"new schema {results['compile_and_plan_ms_median_new_schema']:.2f} ms, "
        f"known schema {results['compile_and_plan_ms_median_known_schema']:.2f} ms"
    )
    print(f"replies that parse, validate and stay finite (seeds 0..{results['seeds'] - 1}, temperature 1):")
    for case in (*(f"{kind}_{max_tokens}" for kind, _, max_tokens in CASES), "random_schemas_64"):
        before, after = results["replies_before"][case], results["replies_after"][case]
        print(
            f"  {case:<18} before {before['held']:>3}/{before['of']:<3} after {after['held']:>3}/{after['of']:<3}"
            f" (after: {after['refused']} refused with a 400)"
        )
    print("grammar work per constrained token (mask + budget check), fresh searches per token:")
    for budget in ("roomy", "tight"):
        before, after = results[f"grammar_{budget}_before"], results[f"grammar_{budget}_after"]
        print(
            f"  {budget}: before {before['us_per_token']:.0f} us  after {after['us_per_token']:.0f} us"
            f"  ({after['searches_per_token']:.2f} searches/token)"
        )
    print(f"replies of {results['reply_tokens']} tokens; output tokens/s (median):")
    for concurrency in (1, 16):
        free = results[f"free_c{concurrency}_tokens_per_s"]
        before = results[f"json_schema_before_c{concurrency}_tokens_per_s"]
        bound = results[f"json_schema_c{concurrency}_tokens_per_s"]
        print(
            f"  concurrency {concurrency:>2}: free {free:7.0f}  json_schema before {before:7.0f} ({before / free:.0%})"
            f"  after {bound:7.0f} ({bound / free:.0%})"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    measured = asyncio.run(main(args.rounds, args.seeds))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    stamped = {
        "benchmark": "structured_output",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **measured,
    }
    RESULTS.write_text(json.dumps(stamped, indent=2) + "\n")
    _print(measured)
    print(f"wrote {RESULTS.relative_to(ROOT)}")
