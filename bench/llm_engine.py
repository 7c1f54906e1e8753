"""The transformers engine alone (no gateway, no data port): output tokens/s and time to first token.

    .venv/bin/python bench/llm_engine.py [--requests 48] [--tokens 64] [--concurrency 1 16] [--threads 1]

Builds `tiny-chat` (examples/make_models.py) in a temp folder, loads it with the model-pool's
`TransformersEngine` on CPU (transformers' continuous-batching manager on its own thread),
then for each concurrency runs `--requests` chat requests of exactly `--tokens` output
tokens (sampled, seeded, no stop strings; eos is ignored only by chance: a stream that
ends early counts the tokens it produced) from that many concurrent async clients.
Output tokens/s = all output tokens / wall time; time to first token = submit -> first
chunk; inter-token latency = gaps between a stream's chunks. Writes
bench/results/llm_engine.json.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import tempfile
import time
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


def _build(root: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_models", ROOT / "examples" / "make_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (root / "tiny-chat").mkdir(parents=True)
    source = ROOT / "examples" / "models" / "tiny-chat" / "config.yaml"
    (root / "tiny-chat" / "config.yaml").write_text(source.read_text())
    module.build(["tiny-chat"], root=root)


async def _one(engine: TransformersEngine, index: int, tokens: int) -> dict[str, Any]:
    request = GenerationRequest(
        f"bench-{index}",
        SamplingParams(max_tokens=tokens, temperature=1.0, seed=index),
        messages=(ChatMessage("user", f"request number {index}: tell me about GPUs"),),
    )
    started = time.perf_counter()
    stream = await engine.submit(request)
    first: float | None = None
    gaps: list[float] = []
    last = started
    produced = 0
    async for event in stream:
        now = time.perf_counter()
        if isinstance(event, GenerationEnd):
            produced = event.usage.completion_tokens
            break
        if first is None:
            first = now - started
        else:
            gaps.append(now - last)
        last = now
    return {"ttft_s": first if first is not None else 0.0, "gaps_s": gaps, "tokens": produced}


async def _run(engine: TransformersEngine, *, concurrency: int, requests: int, tokens: int) -> dict[str, Any]:
    pending = list(range(requests))
    results: list[dict[str, Any]] = []

    async def client() -> None:
        while pending:
            results.append(await _one(engine, pending.pop(0), tokens))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    total = sum(r["tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "requests": requests,
        "output_tokens": total,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(total / wall, 1),
        "time_to_first_token": percentiles_ms([r["ttft_s"] for r in results]),
        "inter_token_latency": percentiles_ms([g for r in results for g in r["gaps_s"]]),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="loadmaster-llm-bench-") as tmp:
        root = Path(tmp) / "models"
        _build(root)
        spec = ModelRepository(root).spec("tiny-chat")
        engine = TransformersEngine(spec, EngineContext(device="cpu", threads=args.threads))
        started = time.perf_counter()
        await asyncio.to_thread(engine.load)
        await asyncio.to_thread(engine.warmup)
        load_s = time.perf_counter() - started
        try:
            await _run(engine, concurrency=4, requests=8, tokens=8)  # warm the paths
            runs = []
            for concurrency in args.concurrency:
                run = await _run(engine, concurrency=concurrency, requests=args.requests, tokens=args.tokens)
                runs.append(run)
                print(
                    f"concurrency {concurrency:3d}: {run['output_tokens_per_s']:8.1f} output tokens/s, "
                    f"TTFT p50 {run['time_to_first_token']['p50_ms']:.1f} ms "
                    f"p99 {run['time_to_first_token']['p99_ms']:.1f} ms, "
                    f"ITL p50 {run['inter_token_latency']['p50_ms']:.2f} ms "
                    f"p99 {run['inter_token_latency']['p99_ms']:.2f} ms",
                    flush=True,
                )
        finally:
            await asyncio.to_thread(engine.unload)
    return {
        "model": "tiny-chat (random Llama, 2 layers, hidden 128)",
        "device": "cpu",
        "torch_threads": args.threads,
        "torch": torch.__version__,
        "load_and_warmup_s": round(load_s, 3),
        "tokens_per_request": args.tokens,
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    import transformers

    result["transformers"] = transformers.__version__
    print(f"wrote {write_result('llm_engine', result)}")


if __name__ == "__main__":
    main()
