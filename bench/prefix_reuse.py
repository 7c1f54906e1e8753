"""Prefix reuse: time to first token for a 1,000-token shared system prompt, warm against cold.

    .venv/bin/python bench/prefix_reuse.py [--rounds 20] [--prompt-tokens 1000] [--threads 1]

Builds `tiny-chat` (examples/make_models.py) in a temp folder with its example config
(block_size 64, num_blocks 512; max_position_embeddings 2048 holds a 1,000-token prompt),
loads it with the model-pool's `TransformersEngine` on CPU, then alternates, `--rounds` times:

- cold: a chat whose system prompt is new (a fresh first line, so no KV page matches);
- warm: a chat whose system prompt is the shared one (computed once before the rounds),
  with a different user question each round.

Both are ~`--prompt-tokens` long and generate 4 greedy tokens; time to first token =
submit -> first chunk, on an otherwise idle engine. The engine's own counters
(prefix lookups, hits, tokens reused) are read before and after each request. A second
part replays the same 2-worker placement with and without prefix affinity
(scheduler/placement.py) over many prefixes and a per-worker LRU of cached prefixes: the
hit rates that decided the design (docs/prefix-reuse.md). Writes bench/results/prefix_reuse.json.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from _harness import ROOT, percentiles_ms, write_result

from loadmaster.model_pool.engines import EngineContext
from loadmaster.model_pool.engines.transformers import TransformersEngine
from loadmaster.model_pool.generation import (
    ChatMessage,
    GenerationEnd,
    GenerationRequest,
    SamplingParams,
)
from loadmaster.model_pool.repository import ModelRepository
from loadmaster.scheduler.placement import GrantCandidate, pick_grant_worker


def _build(root: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_models", ROOT / "examples" / "make_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (root / "tiny-chat").mkdir(parents=True)
    source = ROOT / "examples" / "models" / "tiny-chat" / "config.yaml"
    (root / "tiny-chat" / "config.yaml").write_text(source.read_text())
    module.build(["tiny-chat"], root=root)


def _system_text(tokenizer: Any, tokens: int, *, first_line: str) -> str:
    """`first_line` then the repo's docs (the tokenizer's corpus), cut to about `tokens` tokens."""
    corpus = json.loads((ROOT / "examples" / "models" / "tiny-chat" / "tokenizer_corpus.json").read_text())
    text = first_line + "\n" + "\n".join(corpus)
    ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
    return str(tokenizer.decode(ids))


async def _ttft(engine: TransformersEngine, request_id: str, system: str, question: str) -> dict[str, Any]:
    request = GenerationRequest(
        request_id,
        SamplingParams(max_tokens=4, temperature=0.0),
        messages=(ChatMessage("system", system), ChatMessage("user", question)),
    )
    before = engine.stats()
    started = time.perf_counter()
    stream = await engine.submit(request)
    first: float | None = None
    tokens: list[int] = []
    async for event in stream:
        if isinstance(event, GenerationEnd):
            break
        if first is None:
            first = time.perf_counter() - started
        tokens.extend(event.token_ids)
    after = engine.stats()
    return {
        "ttft_s": first or 0.0,
        "prompt_tokens": stream.prompt_tokens,
        "tokens_reused": after.prefix_tokens_reused - before.prefix_tokens_reused,
        "tokens": tokens,
    }


async def _engine_part(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="loadmaster-prefix-bench-") as tmp:
        root = Path(tmp) / "models"
        _build(root)
        spec = ModelRepository(root).spec("tiny-chat")
        engine = TransformersEngine(spec, EngineContext(device="cpu", threads=args.threads))
        await asyncio.to_thread(engine.load)
        await asyncio.to_thread(engine.warmup)
        try:
            tokenizer = engine._tokenizer
            shared = _system_text(
                tokenizer, args.prompt_tokens, first_line="You are the Loadmaster assistant."
            )
            primed = await _ttft(engine, "prime", shared, "question 0?")  # computes the shared prompt once
            cold: list[dict[str, Any]] = []
            warm: list[dict[str, Any]] = []
            for index in range(1, args.rounds + 1):
                fresh = _system_text(
                    tokenizer, args.prompt_tokens, first_line=f"Session {index} of {time.time()}."
                )
                cold.append(await _ttft(engine, f"cold-{index}", fresh, f"question {index}?"))
                warm.append(await _ttft(engine, f"warm-{index}", shared, f"question {index}?"))
            stats = engine.stats()
        finally:
            await asyncio.to_thread(engine.unload)
    cold_ttft = percentiles_ms([r["ttft_s"] for r in cold])
    warm_ttft = percentiles_ms([r["ttft_s"] for r in warm])
    return {
        "block_size": spec.config.block_size,  # type: ignore[union-attr]
        "prompt_tokens": {"cold": cold[0]["prompt_tokens"], "warm": warm[0]["prompt_tokens"]},
        "first_shared_request_ttft_ms": round(primed["ttft_s"] * 1000, 3),
        "cold": {"time_to_first_token": cold_ttft, "tokens_reused_mean": _mean(cold, "tokens_reused")},
        "warm": {"time_to_first_token": warm_ttft, "tokens_reused_mean": _mean(warm, "tokens_reused")},
        "speedup_p50": round(cold_ttft["p50_ms"] / max(warm_ttft["p50_ms"], 1e-9), 2),
        "engine_counters": {
            "prefix_lookups": stats.prefix_lookups,
            "prefix_hits": stats.prefix_hits,
            "prefix_tokens_reused": stats.prefix_tokens_reused,
            "prefix_blocks_evicted": stats.prefix_blocks_evicted,
        },
    }


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return round(sum(r[key] for r in rows) / max(1, len(rows)), 1)


def _placement_part(*, prefixes: int, requests: int, capacity: int, seed: int = 0) -> dict[str, Any]:
    """Two workers, `prefixes` system prompts with Zipf-like popularity, each worker caching
    the `capacity` prefixes it served last (LRU). Hit = the chosen worker already held it."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) for rank in range(prefixes)]
    stream = rng.choices(range(prefixes), weights=weights, k=requests)
    result: dict[str, Any] = {"prefixes": prefixes, "requests": requests, "capacity_per_worker": capacity}
    for name, affinity in (("least_inflight", False), ("prefix_affinity", True)):
        caches: dict[str, OrderedDict[int, None]] = {"w1": OrderedDict(), "w2": OrderedDict()}
        inflight = {"w1": 0, "w2": 0}
        pick_rng = random.Random(seed)
        hits = 0
        for index, prefix in enumerate(stream):
            # a steady trickle: one request in flight on a random worker half of the time
            busy = pick_rng.choice(["w1", "w2", None, None])
            for worker in inflight:
                inflight[worker] = 1 if worker == busy else 0
            candidates = [GrantCandidate(w, inflight[w]) for w in ("w1", "w2")]
            key = f"prefix-{prefix}" if affinity else ""
            chosen = pick_grant_worker(candidates, max_inflight=8, rng=pick_rng, affinity_key=key)
            assert chosen is not None, index
            cache = caches[chosen]
            if prefix in cache:
                hits += 1
                cache.move_to_end(prefix)
            else:
                cache[prefix] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
        result[name] = {"hit_rate": round(hits / requests, 3)}
    return result


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    engine = await _engine_part(args)
    cold, warm = engine["cold"]["time_to_first_token"], engine["warm"]["time_to_first_token"]
    print(
        f"{engine['prompt_tokens']['warm']}-token prompt, block_size {engine['block_size']}: "
        f"TTFT cold p50 {cold['p50_ms']:.1f} ms p90 {cold['p90_ms']:.1f} ms | "
        f"warm p50 {warm['p50_ms']:.1f} ms p90 {warm['p90_ms']:.1f} ms | "
        f"x{engine['speedup_p50']} | warm reused {engine['warm']['tokens_reused_mean']:.0f} tokens, "
        f"cold {engine['cold']['tokens_reused_mean']:.0f}",
        flush=True,
    )
    placement = _placement_part(prefixes=64, requests=4000, capacity=16)
    print(
        f"placement, 2 workers, {placement['prefixes']} prefixes, LRU of {placement['capacity_per_worker']} "
        f"per worker: hit rate least-inflight {placement['least_inflight']['hit_rate']:.3f}, "
        f"prefix affinity {placement['prefix_affinity']['hit_rate']:.3f}",
        flush=True,
    )
    return {
        "model": "tiny-chat (random Llama, 2 layers, hidden 128)",
        "device": "cpu",
        "torch_threads": args.threads,
        "torch": torch.__version__,
        "rounds": args.rounds,
        "engine": engine,
        "placement_simulation": placement,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    import transformers

    result["transformers"] = transformers.__version__
    print(f"wrote {write_result('prefix_reuse', result)}")


if __name__ == "__main__":
    main()
