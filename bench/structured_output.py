"""What structured output costs in the transformers engine (tiny-chat on CPU, one torch thread).

Runs the engine in-process (no gateway) and measures, for 1 and 16 concurrent sequences:
output tokens/s of free text against the same load with `response_format` json_schema (a
schema that makes long replies: 12 strings of 4-6 characters). Also the first constrained
request's extra latency (llguidance converts the tokenizer once per loaded model) and a
schema's compile time on a warm engine, and the time spent in the grammar mask per
constrained token (timed around `GrammarMask`'s two methods). Constrained replies vary in
length (free ones all run to max_tokens), so at concurrency 16 the constrained batch thins out
before it ends: part of the gap in tokens/s is that tail, not the mask. Prints a table, writes
bench/results/structured_output.json.

    .venv/bin/python bench/structured_output.py [--rounds 3]

Needs `make models`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from loadmaster.model_pool.engines import EngineContext, grammar
from loadmaster.model_pool.engines.transformers import TransformersEngine
from loadmaster.model_pool.generation import (
    GenerationRequest,
    ResponseFormat,
    SamplingParams,
    TokenChunk,
)
from loadmaster.model_pool.repository import ModelRepository

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "structured_output.json"
LONG = {
    "type": "array",
    "items": {"type": "string", "minLength": 4, "maxLength": 6},
    "minItems": 12,
    "maxItems": 12,
}
_ids = iter(range(1 << 30))
_spent = [0.0]  # seconds inside GrammarMask (bring matchers up to date, fill and apply masks)


def _timed(method: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            _spent[0] += time.perf_counter() - began

    return wrapper


grammar.GrammarMask.prepare_tensor_args = _timed(grammar.GrammarMask.prepare_tensor_args)  # type: ignore[method-assign]
grammar.GrammarMask.__call__ = _timed(grammar.GrammarMask.__call__)  # type: ignore[method-assign]
_tokens = [0]


async def _one(engine: TransformersEngine, *, constrained: bool, max_tokens: int, seed: int) -> int:
    response_format = ResponseFormat("json_schema", json.dumps(LONG)) if constrained else None
    request = GenerationRequest(
        f"b{next(_ids)}",
        SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed),
        prompt="hello",
        response_format=response_format,
    )
    tokens = 0
    async for event in engine.generate(request):
        if isinstance(event, TokenChunk):
            tokens += len(event.token_ids)
    if constrained:
        _tokens[0] += tokens
    return tokens


async def _rate(engine: TransformersEngine, *, constrained: bool, concurrency: int, max_tokens: int) -> float:
    began = time.perf_counter()
    counts = await asyncio.gather(
        *(_one(engine, constrained=constrained, max_tokens=max_tokens, seed=i) for i in range(concurrency))
    )
    return sum(counts) / (time.perf_counter() - began)


async def main(rounds: int) -> dict[str, Any]:
    engine = TransformersEngine(
        ModelRepository(ROOT / "examples" / "models").spec("tiny-chat"),
        EngineContext(device="cpu", threads=1),
    )
    engine.load()
    engine.warmup()
    results: dict[str, Any] = {}
    began = time.perf_counter()
    await _one(engine, constrained=True, max_tokens=1, seed=0)
    results["first_constrained_request_ms"] = (time.perf_counter() - began) * 1e3
    assert engine._grammars is not None
    compile_ms = []
    for _ in range(20):
        began = time.perf_counter()
        engine._grammars.constraint(ResponseFormat("json_schema", json.dumps(LONG)))
        compile_ms.append((time.perf_counter() - began) * 1e3)
    results["schema_compile_ms_median"] = statistics.median(compile_ms)
    # Free text gets the constrained replies' mean length as max_tokens: equal work.
    probe = await asyncio.gather(*(_one(engine, constrained=True, max_tokens=200, seed=i) for i in range(16)))
    max_tokens = round(statistics.mean(probe))
    results["reply_tokens"] = max_tokens
    _spent[0], _tokens[0] = 0.0, 0
    for concurrency in (1, 16):
        for constrained in (False, True):
            rates = [
                await _rate(engine, constrained=constrained, concurrency=concurrency, max_tokens=max_tokens)
                for _ in range(rounds)
            ]
            key = f"{'json_schema' if constrained else 'free'}_c{concurrency}_tokens_per_s"
            results[key] = statistics.median(rates)
    results["grammar_us_per_constrained_token"] = _spent[0] / max(1, _tokens[0]) * 1e6
    engine.unload()
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = asyncio.run(main(args.rounds))
    print(
        f"first constrained request (tokenizer conversion + compile): {results['first_constrained_request_ms']:.0f} ms"
    )
    print(f"schema compile on a warm engine: {results['schema_compile_ms_median']:.2f} ms (median of 20)")
    print(f"grammar work per constrained token: {results['grammar_us_per_constrained_token']:.0f} us")
    print(f"replies of {results['reply_tokens']} tokens; output tokens/s (median of {args.rounds}):")
    for concurrency in (1, 16):
        free = results[f"free_c{concurrency}_tokens_per_s"]
        bound = results[f"json_schema_c{concurrency}_tokens_per_s"]
        print(
            f"  concurrency {concurrency:>2}: free {free:7.0f}  json_schema {bound:7.0f}  ({bound / free:.0%})"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    results = {"benchmark": "structured_output", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **results}
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")
