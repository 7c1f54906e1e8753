"""`n` choices from one prompt: forked after one prefill, against n separate sequences.

    .venv/bin/python bench/choices_prefill.py [--rounds 6] [--n 4] [--prompt-tokens 1000] [--threads 1]

Loads `tiny-chat` (examples/models, built by `make models`) with the model-pool's
`TransformersEngine` on CPU, then alternates, `--rounds` times, three ways of getting `--n`
sampled replies (8 tokens each) to one ~`--prompt-tokens` prompt that no earlier round used
(a fresh first line, so the prefix cache holds none of it):

- forked: one request with `n` (what the engine does: the manager prefills the prompt once
  and forks the sequence, engines/transformers.py);
- separate: n requests with n = 1, submitted together (what a gateway fanning `n` out into
  requests would do; prefix caching cannot help: no page is complete when they start);
- staggered: one request, then the other n - 1 once its first token came (prefix caching's
  best case: every full 64-token page of the prompt is cached by then).

For each: wall time until every reply ended, the prompt tokens the engine prefilled
(prompt x sequences - tokens reused from the prefix cache; a fork prefills none), on an
otherwise idle engine. Writes bench/results/choices_prefill.json. The numbers decided the
design in docs/tool-calling.md ("n").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from _harness import ROOT, write_result

from loadmaster.model_pool.engines import EngineContext
from loadmaster.model_pool.engines.transformers import TransformersEngine
from loadmaster.model_pool.generation import GenerationEnd, GenerationRequest, SamplingParams
from loadmaster.model_pool.repository import ModelRepository

MAX_TOKENS = 8


def _prompt(engine: TransformersEngine, tokens: int, round_index: int) -> str:
    corpus = json.loads((ROOT / "examples" / "models" / "tiny-chat" / "tokenizer_corpus.json").read_text())
    text = f"round {round_index}: a fresh first line\n" + "\n".join(corpus)
    ids = engine._tokenizer.encode(text, add_special_tokens=False)[:tokens]
    return str(engine._tokenizer.decode(ids))


async def _drain(stream: Any, first: asyncio.Event | None = None) -> None:
    async for event in stream:
        if first is not None:
            first.set()
        if isinstance(event, GenerationEnd):
            return


def _request(request_id: str, prompt: str, *, n: int = 1, seed: int = 0) -> GenerationRequest:
    return GenerationRequest(
        request_id, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed), prompt=prompt, n=n
    )


async def _run(engine: TransformersEngine, way: str, prompt: str, n: int, tag: str) -> dict[str, float]:
    before = engine.stats().prefix_tokens_reused
    prompt_tokens = len(engine._tokenizer.encode(prompt, add_special_tokens=True))
    started = time.perf_counter()
    if way == "forked":
        await _drain(await engine.submit(_request(f"{tag}-f", prompt, n=n)))
        sequences = 1  # the children are forks: their prompt is not prefilled again
    elif way == "separate":
        streams = [await engine.submit(_request(f"{tag}-s{i}", prompt, seed=i)) for i in range(n)]
        await asyncio.gather(*(_drain(s) for s in streams))
        sequences = n
    else:
        first = asyncio.Event()
        head = asyncio.ensure_future(_drain(await engine.submit(_request(f"{tag}-h", prompt)), first))
        await first.wait()
        rest = [await engine.submit(_request(f"{tag}-t{i}", prompt, seed=i)) for i in range(1, n)]
        await asyncio.gather(head, *(_drain(s) for s in rest))
        sequences = n
    elapsed = time.perf_counter() - started
    reused = engine.stats().prefix_tokens_reused - before
    return {"wall_ms": elapsed * 1e3, "prefilled_tokens": float(prompt_tokens * sequences - reused)}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    spec = ModelRepository(ROOT / "examples" / "models").spec("tiny-chat")
    engine = TransformersEngine(spec, EngineContext(device="cpu", threads=args.threads))
    engine.load()
    engine.warmup()
    ways = ("forked", "separate", "staggered")
    samples: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    try:
        for round_index in range(args.rounds):
            for offset in range(len(ways)):  # rotate the order: no way always runs first
                way = ways[(round_index + offset) % len(ways)]
                prompt = _prompt(engine, args.prompt_tokens, round_index * len(ways) + offset)
                samples[way].append(await _run(engine, way, prompt, args.n, f"r{round_index}-{way}"))
    finally:
        engine.unload()
    summary = {
        way: {
            "wall_ms_median": round(statistics.median(s["wall_ms"] for s in runs), 1),
            "prefilled_tokens_median": statistics.median(s["prefilled_tokens"] for s in runs),
            "runs": len(runs),
        }
        for way, runs in samples.items()
    }
    forked = summary["forked"]["wall_ms_median"]
    return {
        "n": args.n,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": MAX_TOKENS,
        "threads": args.threads,
        "ways": summary,
        "separate_over_forked": round(summary["separate"]["wall_ms_median"] / forked, 2),
        "staggered_over_forked": round(summary["staggered"]["wall_ms_median"] / forked, 2),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    result = asyncio.run(main(parser.parse_args()))
    path: Path = write_result("choices_prefill", result)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")
