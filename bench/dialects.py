"""What a dialect costs: time to first token through Ollama's `/api/chat` and Anthropic's
`/v1/messages` against OpenAI's `/v1/chat/completions`, on one suite, one model, one client.

Starts the suite with the example config (or uses `--url` of a running gateway), warms
`tiny-chat`, then sends `--requests` streamed chats per route, interleaved (each round sends
one request per route, in an order shuffled per round, one at a time), the same prompt and
`max_tokens` everywhere, greedy. The clock runs from sending the request to the first event
that carries text (the first NDJSON line with content; the first `content_block_delta`; the
first chunk with a content delta), read with one httpx client. Prints p50/p90/p99/mean per
route, the ratio and difference to OpenAI's, and each route's own translation cost (body ->
the request the plane runs, in-process, median of 2,000), and writes bench/results/dialects.json.

Target (issue 36): each dialect's TTFT within 1.1x of OpenAI's, or within +1 ms, at p50.

    .venv/bin/python bench/dialects.py [--requests 200] [--max-tokens 4] [--url http://127.0.0.1:8000]

Needs `make models`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

import httpx
from _harness import percentiles_ms, running_suite_handle, write_result

MODEL = "tiny-chat"
PROMPT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me about the gateway"}]
ROUTES = ("openai", "ollama", "anthropic")


def _body(route: str, max_tokens: int) -> tuple[str, dict[str, Any], dict[str, str]]:
    if route == "openai":
        body = {
            "model": MODEL,
            "messages": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
        return "/v1/chat/completions", body, {}
    if route == "ollama":
        body = {
            "model": MODEL,
            "messages": PROMPT,
            "stream": True,
            "options": {"num_predict": max_tokens, "temperature": 0},
        }
        return "/api/chat", body, {}
    body = {
        "model": MODEL,
        "system": PROMPT[0]["content"],
        "messages": PROMPT[1:],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    return "/v1/messages", body, {"anthropic-version": "2023-06-01"}


def _has_text(route: str, line: str) -> bool:
    """Whether one line of a route's stream carries generated text."""
    if route == "ollama":
        return bool(line) and bool(json.loads(line).get("message", {}).get("content"))
    if not line.startswith("data: ") or line == "data: [DONE]":
        return False
    payload = json.loads(line[len("data: ") :])
    if route == "openai":
        choices = payload.get("choices") or [{}]
        return bool(choices[0].get("delta", {}).get("content"))
    return payload.get("type") == "content_block_delta" and bool(payload["delta"].get("text"))


def first_token_s(client: httpx.Client, route: str, max_tokens: int) -> float:
    path, body, headers = _body(route, max_tokens)
    started = time.perf_counter()
    first = 0.0
    with client.stream("POST", path, json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{route}: HTTP {response.status_code}: {response.read().decode()[:200]}")
        for line in response.iter_lines():
            if not first and _has_text(route, line):
                first = time.perf_counter() - started
    if not first:
        raise RuntimeError(f"{route}: the stream carried no text")
    return first


def translation_us(max_tokens: int, rounds: int = 2000) -> dict[str, float]:
    """Median microseconds to turn each route's body into the request the plane runs (the
    part of a dialect's cost that is its own: parse, translate, the OpenAI parser)."""
    from loadmaster.gateway.frontends import anthropic, ollama
    from loadmaster.gateway.frontends.openai_schema import parse_chat

    def openai_side(raw: bytes) -> object:
        return parse_chat(raw)

    def ollama_side(raw: bytes) -> object:
        data = json.loads(raw)
        return ollama.parse(ollama.chat_body(data, ollama.ChatBody.model_validate(data)))

    def anthropic_side(raw: bytes) -> object:
        data = json.loads(raw)
        return anthropic.parse(anthropic.messages_body(data, anthropic.MessagesBody.model_validate(data)))

    sides = {"openai": openai_side, "ollama": ollama_side, "anthropic": anthropic_side}
    out = {}
    for route, translate in sides.items():
        raw = json.dumps(_body(route, max_tokens)[1]).encode()
        times = []
        for _ in range(rounds):
            began = time.perf_counter()
            translate(raw)
            times.append(time.perf_counter() - began)
        out[route] = round(statistics.median(times) * 1e6, 1)
    return out


def measure(url: str, requests: int, max_tokens: int, seed: int) -> dict[str, Any]:
    order = random.Random(seed)
    samples: dict[str, list[float]] = {route: [] for route in ROUTES}
    with httpx.Client(base_url=url, timeout=120) as client:
        for route in ROUTES:  # warm: the model, each route's code, the connection
            for _ in range(5):
                first_token_s(client, route, max_tokens)
        began = time.monotonic()
        for _ in range(requests):
            routes = list(ROUTES)
            order.shuffle(routes)
            for route in routes:
                samples[route].append(first_token_s(client, route, max_tokens))
        elapsed = time.monotonic() - began
    stats = {route: percentiles_ms(values) for route, values in samples.items()}
    base = stats["openai"]
    targets = []
    rows = []
    for route in ROUTES:
        p50, mean = stats[route]["p50_ms"], stats[route]["mean_ms"]
        ratio = p50 / base["p50_ms"]
        rows.append(
            {
                "route": route,
                "p50_ms": p50,
                "p90_ms": stats[route]["p90_ms"],
                "p99_ms": stats[route]["p99_ms"],
                "mean_ms": mean,
                "p50 / openai": round(ratio, 3),
                "p50 - openai (ms)": round(p50 - base["p50_ms"], 3),
                "mean - openai (ms)": round(mean - base["mean_ms"], 3),
            }
        )
        if route != "openai":
            met = ratio <= 1.1 or p50 - base["p50_ms"] <= 1.0
            targets.append(
                {
                    "name": f"TTFT p50 via {route} vs /v1/chat/completions",
                    "measured": f"{p50:.2f} ms vs {base['p50_ms']:.2f} ms ({ratio:.3f}x, {p50 - base['p50_ms']:+.2f} ms)",
                    "target": "<= 1.1x or <= +1 ms",
                    "unit": "ms",
                    "met": met,
                }
            )
    return {
        "model": MODEL,
        "requests_per_route": requests,
        "max_tokens": max_tokens,
        "seconds": round(elapsed, 1),
        "ttft": stats,
        "spread_ms": {route: round(statistics.pstdev(v) * 1e3, 3) for route, v in samples.items()},
        "translation_us": translation_us(max_tokens),
        "targets": targets,
        "tables": {"Time to first token per route (interleaved, one at a time)": rows},
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=200, help="streamed chats per route (default 200)")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--url", help="a running gateway's HTTP address (default: start the suite)")
    parser.add_argument("--seed", type=int, default=0, help="the shuffle of each round's order")
    args = parser.parse_args()
    if args.url:
        result = measure(args.url, args.requests, args.max_tokens, args.seed)
    else:
        with running_suite_handle(preload=[]) as suite:
            gateway = suite.settings.gateway
            result = measure(
                f"http://{gateway.http_host}:{gateway.http_port}", args.requests, args.max_tokens, args.seed
            )
    print(
        f"{'route':<10} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'x openai':>9} {'+ms':>7}"
    )
    for row in next(iter(result["tables"].values())):
        print(
            f"{row['route']:<10} {row['p50_ms']:>8.2f} {row['p90_ms']:>8.2f} {row['p99_ms']:>8.2f} "
            f"{row['mean_ms']:>8.2f} {row['p50 / openai']:>9.3f} {row['p50 - openai (ms)']:>+7.2f}"
        )
    print("body -> request, median us:", result["translation_us"])
    for target in result["targets"]:
        print(f"{target['name']}: {target['measured']} -> {'met' if target['met'] else 'MISSED'}")
    print(f"wrote {write_result('dialects', result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
