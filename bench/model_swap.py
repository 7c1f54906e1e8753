"""Two LLMs on one GPU that fits one of them: swap time, and a warm model's time to first
token while another model's cold load waits for its memory (the warm bump, docs/vram-gate.md).

    .venv/bin/python bench/model_swap.py [--swaps 4] [--bursts 1.5 8] [--bumps 0 2000]

Two model configs, `chat-a` and `chat-b`, serve copies of the `tiny-chat` artifacts (built
by `make models`; this script writes them into a temporary repository, so nothing in
examples/ changes). The declared inventory is one GPU of 1000 MB and each model leases 600 MB:
only one fits, so every switch evicts the other.

1. Swap time: a request for the model not loaded, sent after the loaded one went idle, until
   its first token (streamed OpenAI chat completion through the gateway). The worker's own
   load time of the incoming model is reported next to it; a warm request's time to first
   token is the baseline.
2. The warm bump: one client streams requests for `chat-a` back to back; a second asks once
   for `chat-b`, and chat-a's stream goes on for --bursts seconds after that (a burst shorter
   than the bump's bound, and one longer). For each `warm_bump_max_ms` in --bumps (0 = off)
   the suite is started with it, and the script records chat-a's time to first token after
   chat-b's request (how many took over 250 ms: they waited for a swap), and chat-b's own.

Writes bench/results/model_swap.json.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _harness import EXAMPLE_CONFIG, ROOT, percentiles_ms, write_result

ARTIFACTS = ROOT / "examples" / "models" / "tiny-chat" / "artifacts"
MODELS = ("chat-a", "chat-b")
GPU_MB, MODEL_MB = 1000, 600
TOKENS = 8


def _repository(root: Path) -> Path:
    if not (ARTIFACTS / "config.json").exists():
        raise SystemExit(f"{ARTIFACTS} is missing: run `make models` first")
    for name in MODELS:  # a copy each (2 MB): a model's path must stay inside its folder
        shutil.copytree(ARTIFACTS, root / name / "artifacts")
        (root / name / "config.yaml").write_text(
            "backend: transformers\npath: artifacts\nmax_sequences: 4\nblock_size: 64\nnum_blocks: 64\n"
        )
    return root


def _suite(repo: Path, logs: Path, *, bump_ms: float) -> Any:
    from loadmaster.cli.launcher import Suite, free_port_overrides

    overrides = free_port_overrides()
    overrides["gpu_broker"].update(
        {"reserve_mb": 0, "declared": {"local": [{"index": 0, "total_mb": GPU_MB, "name": "declared"}]}}
    )
    overrides["model_pool"].update(
        {"preload": ["chat-a"], "eviction_wait_s": 30, "warm_bump_max_ms": bump_ms, "warm_bump_idle_ms": 250}
    )
    overrides["scheduler"] = {**overrides["scheduler"], "request_ttl_ms": 120_000, "vram_gate_retry_ms": 250}
    overrides["models"] = {
        "repository": str(repo),
        "defaults": {"min_resident_s": 0, "max_inflight": 4},
        "known": {name: {"vram_mb": MODEL_MB} for name in MODELS},
    }
    suite = Suite(EXAMPLE_CONFIG, overrides=overrides, log_dir=logs)
    suite.start(timeout_s=180)
    suite.wait_for_models(["chat-a"], timeout_s=180)
    return suite


def _ttft_s(client: Any, model: str) -> float:
    """Seconds from sending a streamed chat completion to its first text."""
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
    )
    first: float | None = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{model}: no text streamed")
    return first - started


def _load_time_ms(suite: Any, model: str) -> float:
    import grpc

    from loadmaster.v1 import model_pool_pb2, model_pool_pb2_grpc

    with grpc.insecure_channel(suite.settings.model_pool.address) as channel:
        reply = model_pool_pb2_grpc.ModelPoolServiceStub(channel).Status(
            model_pool_pb2.StatusRequest(), timeout=5
        )
    return next(m.load_time_ms for m in reply.models if m.model_id == model)


def _client(suite: Any) -> Any:
    import openai

    s = suite.settings.gateway
    return openai.OpenAI(base_url=f"http://{s.http_host}:{s.http_port}/v1", api_key="-", timeout=180)


def measure_swaps(repo: Path, logs: Path, *, swaps: int) -> dict[str, Any]:
    suite = _suite(repo, logs, bump_ms=0)
    try:
        client = _client(suite)
        warm = [_ttft_s(client, "chat-a") for _ in range(5)]
        print(f"warm chat-a: TTFT p50 {sorted(warm)[2] * 1000:.0f} ms")
        runs = []
        loaded = "chat-a"
        for index in range(swaps):
            incoming = MODELS[(index + 1) % 2]
            time.sleep(0.5)  # the loaded model is idle: a plain swap, no bump
            ttft = _ttft_s(client, incoming)
            load_ms = _load_time_ms(suite, incoming)
            runs.append(
                {
                    "from": loaded,
                    "to": incoming,
                    "ttft_ms": round(ttft * 1000, 1),
                    "load_ms": round(load_ms, 1),
                }
            )
            print(
                f"swap {loaded} -> {incoming}: first token after {ttft * 1000:.0f} ms (its load {load_ms:.0f} ms)"
            )
            loaded = incoming
        return {
            "warm_ttft_ms": percentiles_ms(warm),
            "swaps": runs,
            "swap_ttft_ms": percentiles_ms([r["ttft_ms"] / 1000 for r in runs]),
        }
    finally:
        suite.stop()


def _scenario(suite: Any, *, burst_s: float, window_s: float) -> dict[str, Any]:
    """chat-a warm and streamed back to back; chat-b asked once, 1 s in. chat-a's stream goes on
    for `burst_s` after chat-b's request (then stops), and is measured over `window_s`."""
    client_a, client_b = _client(suite), _client(suite)
    for _ in range(3):  # chat-a loaded (swapped back in if need be) and warm
        _ttft_s(client_a, "chat-a")
    time.sleep(0.5)
    samples: list[tuple[float, float]] = []  # (sent, ttft) of chat-a requests
    b_sent = time.perf_counter() + 1.0

    def stream_a() -> None:
        while time.perf_counter() < b_sent + burst_s:
            sent = time.perf_counter()
            samples.append((sent, _ttft_s(client_a, "chat-a")))

    thread = threading.Thread(target=stream_a)
    thread.start()
    time.sleep(max(0.0, b_sent - time.perf_counter()))
    b_ttft = _ttft_s(client_b, "chat-b")
    thread.join(180)
    time.sleep(max(0.0, b_sent + window_s - time.perf_counter()))
    before = [t for sent, t in samples if sent < b_sent]
    during = [t for sent, t in samples if sent >= b_sent]
    return {
        "a_burst_s": burst_s,
        "a_ttft_before_ms": percentiles_ms(before),
        "a_ttft_after_b_ms": percentiles_ms(during),
        "a_requests_after_b": len(during),
        "a_slow_requests_after_b": sum(1 for t in during if t > 0.25),
        "b_ttft_ms": round(b_ttft * 1000, 1),
    }


def measure_bump(repo: Path, logs: Path, *, bump_ms: float, bursts: list[float]) -> dict[str, Any]:
    suite = _suite(repo, logs, bump_ms=bump_ms)
    label = f"bump {bump_ms:.0f} ms" if bump_ms else "no bump"
    try:
        runs = []
        for burst_s in bursts:
            run = _scenario(suite, burst_s=burst_s, window_s=max(burst_s, 6.0))
            during = run["a_ttft_after_b_ms"]
            print(
                f"{label}, chat-a streamed for {burst_s:.1f} s after chat-b's request: chat-a TTFT "
                f"p50 {during['p50_ms']:.0f} ms, max {during['max_ms']:.0f} ms over {during['count']} "
                f"requests ({run['a_slow_requests_after_b']} over 250 ms); "
                f"chat-b first token after {run['b_ttft_ms']:.0f} ms"
            )
            runs.append(run)
        return {"warm_bump_max_ms": bump_ms, "scenarios": runs}
    finally:
        suite.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--swaps", type=int, default=4)
    parser.add_argument(
        "--bursts", type=float, nargs="+", default=[1.5, 8.0], help="seconds chat-a streams on"
    )
    parser.add_argument("--bumps", type=float, nargs="+", default=[0.0, 2000.0])
    parser.add_argument("--skip-swaps", action="store_true")
    args = parser.parse_args()
    result: dict[str, Any] = {"gpu_mb": GPU_MB, "model_mb": MODEL_MB, "device": "cpu", "tokens": TOKENS}
    with tempfile.TemporaryDirectory(prefix="loadmaster-swap-") as tmp:
        repo = _repository(Path(tmp) / "models")
        logs = Path(tmp) / "logs"
        logs.mkdir()
        if not args.skip_swaps:
            result["swap"] = measure_swaps(repo, logs, swaps=args.swaps)
        result["bump"] = [measure_bump(repo, logs, bump_ms=b, bursts=args.bursts) for b in args.bumps]
    path = write_result("model_swap", result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
