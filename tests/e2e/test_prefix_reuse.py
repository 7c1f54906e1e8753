"""Prefix reuse through the real suite with the `openai` client: chats that share a long system
prompt reuse its KV pages in the worker's engine (the metrics service sees prefix hits and reused
tokens), and a repeated greedy question gets the same answer from the reused cache."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import openai

from loadmaster.cli.launcher import Suite

MODEL = "tiny-chat"
SYSTEM = " ".join(f"Rule {i}: every robot arm stays inside its fence." for i in range(60))  # ~700 tokens
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_chats_sharing_a_system_prompt_reuse_it_and_answer_the_same(
    suite: Suite, metrics_count: Callable[[str, dict[str, str]], int]
) -> None:
    gateway = suite.settings.gateway
    client = openai.OpenAI(
        base_url=f"http://{gateway.http_host}:{gateway.http_port}/v1",
        api_key="none",
        max_retries=0,
        timeout=120,
    )
    labels = {"model": MODEL}
    before = {
        name: metrics_count(name, labels) for name in ("prefix_cache_hits", "prefix_cache_reused_tokens")
    }

    def ask(question: str) -> str:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            max_tokens=12,
            temperature=0,
        )
        assert reply.usage is not None and reply.usage.prompt_tokens > 512
        return reply.choices[0].message.content or ""

    first = ask("Where is arm 3?")
    ask("Is fence 2 closed?")
    assert ask("Where is arm 3?") == first  # the same greedy answer from the reused pages
    for _ in range(50):  # bounded: reporters flush every 250 ms
        hits = metrics_count("prefix_cache_hits", labels) - before["prefix_cache_hits"]
        reused = metrics_count("prefix_cache_reused_tokens", labels) - before["prefix_cache_reused_tokens"]
        if hits >= 2 and reused >= 2 * 512:
            break
        time.sleep(0.1)
    assert hits >= 2 and reused >= 2 * 512, (hits, reused)
