"""bench/llm_serving.py's measurement client: one streamed chat request as the client sees
it (`stream_once`, `StreamRecord`), the closed-loop and priority phases built on it, and their
summaries (`summarize`, `combine`). The same code drives every side."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from _harness import percentiles_ms

REQUEST_TIMEOUT_S = 60.0
PROBE_TOKENS = 8


@dataclass(frozen=True, slots=True)
class StreamRecord:
    """One streamed request, as the client saw it."""

    started: float  # perf_counter when it was sent
    ttft_s: float | None  # None: no text arrived
    gaps_s: tuple[float, ...]
    tokens: int  # usage.completion_tokens (text chunks when the server sent no usage)
    error: str | None = None


@dataclass(slots=True)
class Target:
    name: str
    server: str  # the address the client talks to, e.g. http://127.0.0.1:8000/v1
    model: str
    priority_field: bool  # whether requests carry x_priority
    notes: list[str] = field(default_factory=list)
    diagnose: Callable[[], str] | None = None  # the server's log tail, shown when it fails


# ---- one stream ----------------------------------------------------------------------------


async def stream_once(
    client: Any, target: Target, *, index: int, tokens: int, priority: int | None
) -> StreamRecord:
    """Send one streaming chat completion and time its chunks; never raises (errors are recorded)."""
    extra: dict[str, Any] = {}
    if priority is not None and target.priority_field:
        extra["x_priority"] = priority
    started = time.perf_counter()
    first: float | None = None
    last = started
    gaps: list[float] = []
    text_chunks = 0
    usage_tokens: int | None = None
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            stream = await client.chat.completions.create(
                model=target.model,
                messages=[{"role": "user", "content": f"request {index}: tell me about GPUs"}],
                max_tokens=tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra or None,
            )
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    usage_tokens = chunk.usage.completion_tokens
                if chunk.choices and chunk.choices[0].delta.content:
                    text_chunks += 1
                    if first is None:
                        first = now - started
                    else:
                        gaps.append(now - last)
                    last = now
    except Exception as error:  # a failed stream is a measurement, not a crash
        cause = f" ({type(error.__cause__).__name__}: {error.__cause__})" if error.__cause__ else ""
        return StreamRecord(
            started, first, tuple(gaps), text_chunks, f"{type(error).__name__}: {error}{cause}"
        )
    produced = usage_tokens if usage_tokens is not None else text_chunks
    return StreamRecord(started, first, tuple(gaps), produced)


# ---- summaries -----------------------------------------------------------------------------


def _ms(samples_s: list[float]) -> dict[str, float] | None:
    return percentiles_ms(samples_s) if samples_s else None


def summarize(records: list[StreamRecord], wall_s: float) -> dict[str, Any]:
    """Throughput and latency of a set of streams (failed ones are counted, not timed)."""
    ok = [r for r in records if r.error is None]
    errors = [r.error for r in records if r.error is not None]
    tokens = sum(r.tokens for r in ok)
    return {
        "requests": len(records),
        "failed": len(errors),
        "first_error": errors[0] if errors else None,
        "output_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "output_tokens_per_s": round(tokens / wall_s, 1) if wall_s > 0 else 0.0,
        "time_to_first_token": _ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "inter_token_latency": _ms([g for r in ok for g in r.gaps_s]),
        # Per stream, (last text chunk - first) / (tokens - 1): vLLM's "time per output token".
        # Unlike the gaps, it does not depend on how the server groups tokens into chunks.
        "time_per_output_token": _ms(
            [sum(r.gaps_s) / (r.tokens - 1) for r in ok if r.tokens > 1 and r.gaps_s]
        ),
    }


def _check(summary: dict[str, Any], what: str) -> None:
    """A phase where every request failed says so (the side is reported as failed)."""
    if summary["requests"] and summary["failed"] == summary["requests"]:
        raise SideFailedError(f"{what}: every request failed; the first: {summary['first_error']}")


class SideFailedError(Exception):
    pass


# ---- phases --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Window:
    """One closed-loop window: its streams, wall time and the client's CPU time."""

    records: tuple[StreamRecord, ...]
    wall_s: float
    client_cpu_s: float


async def closed_loop_window(
    client: Any, target: Target, *, concurrency: int, requests: int, tokens: int
) -> Window:
    indices = iter(range(requests))
    records: list[StreamRecord] = []

    async def worker() -> None:
        for index in indices:  # the shared iterator hands each request to one worker
            records.append(await stream_once(client, target, index=index, tokens=tokens, priority=None))

    started = time.perf_counter()
    cpu = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Window(tuple(records), time.perf_counter() - started, time.process_time() - cpu)


def combine(concurrency: int, windows: list[Window]) -> dict[str, Any]:
    """One concurrency's figures over its windows: tokens / summed wall time, latencies over
    every stream; each window's tokens/s too, to show the spread."""
    records = [r for w in windows for r in w.records]
    summary = summarize(records, sum(w.wall_s for w in windows))
    cpu_s = sum(w.client_cpu_s for w in windows)
    return {
        "concurrency": concurrency,
        **summary,
        "windows": len(windows),
        "window_tokens_per_s": [
            round(sum(r.tokens for r in w.records if r.error is None) / w.wall_s, 1) for w in windows
        ],
        # The client's own CPU (this process: the openai client, its SSE parsing, asyncio), on
        # the same cores as the server: per output token, and as a share of one core.
        "client_cpu_us_per_token": round(cpu_s / max(1, summary["output_tokens"]) * 1e6, 1),
        "client_cpu_share_of_a_core": round(cpu_s / max(1e-9, summary["wall_s"]), 2),
    }


async def closed_loop(
    client: Any, target: Target, *, concurrency: int, requests: int, tokens: int
) -> dict[str, Any]:
    window = await closed_loop_window(
        client, target, concurrency=concurrency, requests=requests, tokens=tokens
    )
    return combine(concurrency, [window])


async def probes(
    client: Any, target: Target, *, count: int, gap_s: tuple[float, float], seed: int
) -> list[StreamRecord]:
    """`count` sequential priority-0 streams of PROBE_TOKENS tokens, a random gap apart."""
    rng = random.Random(seed)
    out: list[StreamRecord] = []
    for n in range(count):
        out.append(await stream_once(client, target, index=10_000 + n, tokens=PROBE_TOKENS, priority=0))
        await asyncio.sleep(rng.uniform(*gap_s))
    return out


async def priority_under_load(
    client: Any,
    target: Target,
    *,
    background: int,
    tokens: int,
    count: int,
    saturate_s: float = 1.5,
    drain_s: float = 60.0,
) -> dict[str, Any]:
    """Idle probes, then the same probes while `background` priority-2 closed-loop streams run."""
    idle = await probes(client, target, count=count, gap_s=(0.02, 0.08), seed=1)
    stop = asyncio.Event()
    loaded_records: list[StreamRecord] = []
    counter = iter(range(20_000, 10**9))

    async def keep_busy() -> None:
        while not stop.is_set():
            record = await stream_once(client, target, index=next(counter), tokens=tokens, priority=2)
            loaded_records.append(record)
            if record.error is not None:
                await asyncio.sleep(0.2)  # a failing server: don't spin

    tasks = [asyncio.create_task(keep_busy()) for _ in range(background)]
    try:
        await asyncio.sleep(saturate_s)  # every stream sent, the batch full and decoding
        window_start = time.perf_counter()
        loaded = await probes(client, target, count=count, gap_s=(0.05, 0.2), seed=2)
        window_s = time.perf_counter() - window_start
    finally:
        stop.set()
        _, pending = await asyncio.wait(tasks, timeout=drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    in_window = [r for r in loaded_records if r.error is None and r.started >= window_start]
    background_errors = sum(1 for r in loaded_records if r.error is not None)
    idle_s = summarize(idle, 1.0)
    loaded_s = summarize(loaded, 1.0)
    _check(idle_s, "idle priority-0 probes")
    _check(loaded_s, "priority-0 probes under load")
    idle_p50 = (idle_s["time_to_first_token"] or {}).get("p50_ms")
    loaded_p99 = (loaded_s["time_to_first_token"] or {}).get("p99_ms")
    ratio = round(loaded_p99 / idle_p50, 2) if idle_p50 and loaded_p99 is not None else None
    return {
        "probes": count,
        "probe_tokens": PROBE_TOKENS,
        "background_streams": background,
        "background_tokens_per_request": tokens,
        "background_requests_finished": len(loaded_records) - background_errors,
        "background_failed": background_errors,
        "background_requests_started_in_window": len(in_window),
        "probe_window_s": round(window_s, 3),
        "idle_ttft": idle_s["time_to_first_token"],
        "loaded_ttft": loaded_s["time_to_first_token"],
        "idle_failed": idle_s["failed"],
        "loaded_failed": loaded_s["failed"],
        "ratio_loaded_p99_to_idle_p50": ratio,
    }


def _client(target: Target) -> Any:
    """The same client for every side: no retries; idle connections dropped after 1 s, before a
    server's keep-alive timeout (uvicorn's 5 s) can close one the client is about to reuse
    (httpx's own expiry is also 5 s: a race that fails a request between windows)."""
    try:
        import httpx2 as httpx  # the openai client's own fork of httpx (openai >= 3)
    except ImportError:
        import httpx  # type: ignore[no-redef]
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200, keepalive_expiry=1.0)
    return AsyncOpenAI(
        base_url=target.server,
        api_key="bench",
        max_retries=0,
        timeout=REQUEST_TIMEOUT_S,
        http_client=DefaultAsyncHttpxClient(limits=limits, timeout=REQUEST_TIMEOUT_S),
    )


def say(message: str) -> None:
    print(message, flush=True)
