"""Scheduling of generations: urgent first, tenants fair, timeslices (issue 34's targets).

    .venv/bin/python bench/llm_scheduling.py [--scenarios priority tenants weights timeslice]
        [--probes 100] [--fair-s 24] [--side-budget-s 400]

Every side serves the same `tiny-chat` folder (`make models`) with one torch thread and is
driven by the same client code (the official async `openai` client, streaming chat
completions with `stream_options.include_usage`, greedy decoding):

- reference: `transformers serve --continuous-batching` as its docs show (bench/_hf_serve.py),
  FIFO, no priorities and no tenants (it answers 422 to unknown fields, so its requests carry
  neither `x_priority` nor `user`);
- loadmaster: the suite from examples/loadmaster.yaml on free ports, tiny-chat preloaded,
  `generation:` at its defaults (fairness on, no timeslices);
- loadmaster-fairness-off: the same with `generation.fairness: false` (arrival order within
  a priority): a labelled variant, to show what fairness buys;
- loadmaster-weights: tenants weighted 2:1 in the short tenant's favour (`tenants:`);
- loadmaster-timeslice: `generation.timeslice_tokens` 16 (timeslices on).

Scenarios:
- priority: --probes sequential priority-0 streams of 16 tokens on the idle model, then the
  same while 64 priority-2 streams of 128 tokens (closed loop) saturate it. Time to first
  token p99 loaded / idle p99 (target <= 3), and loaded p99 below the reference's. The aim,
  also printed: <= 1.2 x (idle TTFT p50 + one saturated decode step), the step being the
  background streams' time per output token p50 in the same window.
- tenants: two tenants at one priority, both always backlogged: "long" keeps 32 streams of
  256 tokens in flight, "short" 32 streams of 16 tokens, short prompts. Service = prompt
  tokens + 2 x output tokens (usage); each stream's output service is spread evenly over its
  life (first token to end), its prompt counted when it was sent. The short tenant's share
  over --fair-s seconds (after 3 s of warm-up) (target >= 0.45) and in each 2 s window
  (target >= 0.35). Tenants are the OpenAI `user` field.
- weights: the same on loadmaster-weights: the short tenant's share (target 0.67 +- 0.05).
- timeslice: 48 priority-2 streams of 128 tokens saturate the model (64 sequences) together
  with 32 priority-1 streams of 128 tokens, all closed loop, so priority-1 work waits for a
  place; priority-1 probes of 16 tokens: their TTFT with timeslices off (loadmaster) and on
  (loadmaster-timeslice), with the yields and resumptions the worker counted.

The background streams of every scenario run in a process of their own (the same client
code, its own event loop), on both servers alike: with 64 streams parsed in the probes' own
loop, a probe's first chunk waited tens of milliseconds for the client itself (measured:
gateway -> client p50 41 ms under load), which says nothing about either server.

Writes bench/results/llm_scheduling.json and prints each target, met or not.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shlex
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _harness import EXAMPLE_CONFIG, percentiles_ms, write_result
from _llm_client import REQUEST_TIMEOUT_S, Target, _client, say
from _llm_servers import MODEL_FOLDER

PROBE_TOKENS = 16
BACKGROUND_STREAMS = 64
BACKGROUND_TOKENS = 128
WINDOW_S = 2.0


@dataclass(frozen=True, slots=True)
class Stream:
    tenant: str
    sent: float  # perf_counter
    first: float | None
    ended: float
    prompt_tokens: int
    output_tokens: int
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.sent


async def stream_once(
    client: Any,
    target: Target,
    *,
    index: int,
    tokens: int,
    priority: int | None = None,
    tenant: str = "",
) -> Stream:
    """One streamed chat completion; never raises (an error is recorded)."""
    extra: dict[str, Any] = {}
    if target.priority_field and priority is not None:
        extra["x_priority"] = priority
    user = {"user": tenant} if target.priority_field and tenant else {}
    sent = time.perf_counter()
    first: float | None = None
    usage = (0, 0)
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
                **user,
            )
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter()
    except Exception as error:
        return Stream(tenant, sent, first, time.perf_counter(), 0, 0, f"{type(error).__name__}: {error}")
    return Stream(tenant, sent, first, time.perf_counter(), *usage)


async def closed_loop(
    client: Any,
    target: Target,
    *,
    streams: int,
    tokens: int,
    priority: int | None,
    tenant: str,
    stop: asyncio.Event,
    out: list[Stream],
    first_index: int,
) -> None:
    counter = iter(range(first_index, first_index + 10**8))

    async def one() -> None:
        while not stop.is_set():
            record = await stream_once(
                client, target, index=next(counter), tokens=tokens, priority=priority, tenant=tenant
            )
            out.append(record)
            if record.error is not None:
                await asyncio.sleep(0.2)  # a failing server: do not spin

    await asyncio.gather(*(one() for _ in range(streams)))


@dataclass(frozen=True, slots=True)
class Load:
    """One closed-loop group of the background load."""

    streams: int
    tokens: int
    priority: int | None
    tenant: str
    first_index: int


def _load_main(target: Target, loads: list[Load], stop: Any, out: Any) -> None:
    """The background process: run `loads` until `stop` is set, then send the records back."""

    async def run() -> list[Stream]:
        client = _client(target)
        records: list[Stream] = []
        done = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                await asyncio.sleep(0.05)
            done.set()

        watcher = asyncio.create_task(watch())
        try:
            await asyncio.gather(
                *(
                    closed_loop(
                        client,
                        target,
                        streams=load.streams,
                        tokens=load.tokens,
                        priority=load.priority,
                        tenant=load.tenant,
                        stop=done,
                        out=records,
                        first_index=load.first_index,
                    )
                    for load in loads
                )
            )
        finally:
            watcher.cancel()
            await client.close()
        return records

    records = asyncio.run(run())
    out.put([tuple(getattr(r, f) for f in Stream.__slots__) for r in records])


class Background:
    """The background load in its own process (`async with`: started, then stopped and read)."""

    def __init__(self, target: Target, loads: list[Load]) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._out = context.Queue()
        self._process = context.Process(
            target=_load_main,
            args=(dataclasses.replace(target, diagnose=None), loads, self._stop, self._out),
            daemon=True,
        )
        self.records: list[Stream] = []

    async def __aenter__(self) -> Background:
        self._process.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        try:
            rows = await asyncio.to_thread(self._out.get, True, REQUEST_TIMEOUT_S + 30)
            self.records = [Stream(*row) for row in rows]
        finally:
            await asyncio.to_thread(self._process.join, 10)
            if self._process.is_alive():
                self._process.kill()


async def probes(client: Any, target: Target, *, count: int, priority: int, seed: int) -> list[Stream]:
    import random

    rng = random.Random(seed)
    out: list[Stream] = []
    for n in range(count):
        out.append(
            await stream_once(client, target, index=50_000 + n, tokens=PROBE_TOKENS, priority=priority)
        )
        await asyncio.sleep(rng.uniform(0.02, 0.08))
    return out


def _ttft(records: list[Stream]) -> dict[str, float] | None:
    samples = [r.ttft_s for r in records if r.error is None and r.ttft_s is not None]
    return percentiles_ms(samples) if samples else None


def _failed(records: list[Stream]) -> int:
    return sum(1 for r in records if r.error is not None)


def _step_ms(records: list[Stream], since: float) -> float | None:
    """The background streams' time per output token (p50) among those that started after
    `since`: one decode step over the saturated batch."""
    per_token = [
        (r.ended - r.first) / (r.output_tokens - 1)
        for r in records
        if r.error is None and r.first is not None and r.sent >= since and r.output_tokens > 1
    ]
    return round(statistics.median(per_token) * 1e3, 2) if per_token else None


# ---- scenarios ------------------------------------------------------------------------------


_METRICS: dict[str, str] = {}  # side -> its metrics service address (Loadmaster sides)


def _stats(side: str, name: str, labels: dict[str, str], window_s: float) -> dict[str, float] | None:
    """A series' percentiles over the last `window_s` from the side's metrics service."""
    address = _METRICS.get(side)
    if address is None:
        return None
    import grpc

    from loadmaster.v1 import metrics_pb2, metrics_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stats = (
            metrics_pb2_grpc.MetricsServiceStub(channel)
            .GetStats(metrics_pb2.GetStatsRequest(name=name, labels=labels, window_s=window_s), timeout=5)
            .stats
        )
    if not stats.count:
        return None
    return {"count": stats.count, "p50_ms": round(stats.p50, 2), "p99_ms": round(stats.p99, 2)}


async def priority(client: Any, target: Target, args: argparse.Namespace) -> dict[str, Any]:
    say(f"[{target.name}] priority: {args.probes} idle priority-0 probes…")
    idle = await probes(client, target, count=args.probes, priority=0, seed=1)
    async with Background(
        target, [Load(BACKGROUND_STREAMS, BACKGROUND_TOKENS, 2, "background", 100_000)]
    ) as load:
        await asyncio.sleep(4.0)  # the process started, every stream sent, the batch full and decoding
        say(f"[{target.name}] priority: {args.probes} priority-0 probes under {BACKGROUND_STREAMS} streams…")
        window = time.perf_counter()
        loaded = await probes(client, target, count=args.probes, priority=0, seed=2)
    background = load.records
    idle_ttft, loaded_ttft = _ttft(idle), _ttft(loaded)
    step = _step_ms(background, window)
    window_s = time.perf_counter() - window
    # where a loaded probe's time went, as the suite saw it: arrival at the worker -> its first
    # token (the engine's queue and its prefill), and the gateway's request -> first chunk
    await asyncio.sleep(1.5)  # the services report in batches
    breakdown = {
        "worker_wait_to_first_token": await asyncio.to_thread(
            _stats, target.name, "generation_queue_wait_ms", {"model": "tiny-chat", "priority": "0"}, window_s
        ),
        "gateway_time_to_first_token": await asyncio.to_thread(
            _stats, target.name, "time_to_first_token_ms", {"model": "tiny-chat"}, window_s
        ),
    }
    ratio = None
    aim = None
    if idle_ttft and loaded_ttft:
        ratio = round(loaded_ttft["p99_ms"] / idle_ttft["p99_ms"], 2)
        if step is not None:
            aim = round(1.2 * (idle_ttft["p50_ms"] + step), 2)
    return {
        "probes": args.probes,
        "probe_tokens": PROBE_TOKENS,
        "background": f"{BACKGROUND_STREAMS} priority-2 streams x {BACKGROUND_TOKENS} tokens",
        "idle_ttft": idle_ttft,
        "loaded_ttft": loaded_ttft,
        "idle_failed": _failed(idle),
        "loaded_failed": _failed(loaded),
        "background_finished": len(background) - _failed(background),
        "background_failed": _failed(background),
        "saturated_step_ms": step,
        "ratio_loaded_p99_to_idle_p99": ratio,
        "aim_ms": aim,
        "suite_breakdown_loaded": breakdown,
    }


def _service_windows(
    records: list[Stream], start: float, end: float
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Each tenant's service (prompt + 2 x output) in [start, end) and in each WINDOW_S window."""
    count = max(1, int((end - start) // WINDOW_S))
    windows: list[dict[str, float]] = [{} for _ in range(count)]
    total: dict[str, float] = {}

    def add(tenant: str, t0: float, t1: float, amount: float) -> None:
        """Spread `amount` evenly over [t0, t1] (a point when t1 <= t0), clipped to the run."""
        if t1 <= t0:
            if start <= t0 < start + count * WINDOW_S:
                index = int((t0 - start) // WINDOW_S)
                windows[index][tenant] = windows[index].get(tenant, 0.0) + amount
                total[tenant] = total.get(tenant, 0.0) + amount
            return
        rate = amount / (t1 - t0)
        for index in range(count):
            w0, w1 = start + index * WINDOW_S, start + (index + 1) * WINDOW_S
            overlap = min(t1, w1) - max(t0, w0)
            if overlap > 0:
                windows[index][tenant] = windows[index].get(tenant, 0.0) + rate * overlap
                total[tenant] = total.get(tenant, 0.0) + rate * overlap

    for r in records:
        if r.error is not None or r.first is None:
            continue
        add(r.tenant, r.sent, r.sent, float(r.prompt_tokens))
        add(r.tenant, r.first, r.ended, 2.0 * r.output_tokens)
    return total, windows


async def tenants(client: Any, target: Target, args: argparse.Namespace) -> dict[str, Any]:
    say(f"[{target.name}] tenants: long 32 x 256 tokens vs short 32 x 16, {args.fair_s:g} s…")
    warmup_s = 4.0
    started = time.perf_counter()
    async with Background(
        target, [Load(32, 256, 1, "long", 200_000), Load(32, 16, 1, "short", 300_000)]
    ) as load:
        await asyncio.sleep(warmup_s + args.fair_s)
    records = load.records
    start = started + warmup_s
    total, windows = _service_windows(records, start, start + args.fair_s)
    share = _share(total)
    window_shares = [s for w in windows if (s := _share(w)) is not None]
    return {
        "seconds": args.fair_s,
        "streams": {
            "long": len([r for r in records if r.tenant == "long"]),
            "short": len([r for r in records if r.tenant == "short"]),
        },
        "failed": _failed(records),
        "service": {k: round(v) for k, v in total.items()},
        "short_share": None if share is None else round(share, 3),
        "short_share_min_window": round(min(window_shares), 3) if window_shares else None,
        "short_share_windows": [round(s, 3) for s in window_shares],
        "output_tokens_per_s": round(
            sum(r.output_tokens for r in records if r.error is None)
            / max(1e-9, time.perf_counter() - started),
            1,
        ),
    }


def _share(service: dict[str, float]) -> float | None:
    total = service.get("short", 0.0) + service.get("long", 0.0)
    return service.get("short", 0.0) / total if total > 0 else None


async def timeslice(client: Any, target: Target, args: argparse.Namespace) -> dict[str, Any]:
    say(f"[{target.name}] timeslice: priority-1 probes behind 48 priority-2 + 32 priority-1 streams…")
    loads = [Load(48, BACKGROUND_TOKENS, 2, "p2", 400_000), Load(32, BACKGROUND_TOKENS, 1, "p1", 500_000)]
    async with Background(target, loads) as load:
        await asyncio.sleep(4.0)
        window = time.perf_counter()
        loaded = await probes(client, target, count=max(20, args.probes // 2), priority=1, seed=3)
        elapsed = time.perf_counter() - window
    background = load.records
    in_window = [r for r in background if r.error is None and r.sent >= window]
    return {
        "probe_ttft": _ttft(loaded),
        "probes_failed": _failed(loaded),
        "background_failed": _failed(background),
        "priority_2_tokens_per_s": round(
            sum(r.output_tokens for r in in_window if r.tenant == "p2") / max(elapsed, 1e-9), 1
        ),
        "priority_1_tokens_per_s": round(
            sum(r.output_tokens for r in in_window if r.tenant == "p1") / max(elapsed, 1e-9), 1
        ),
    }


SCENARIOS: dict[str, Callable[[Any, Target, argparse.Namespace], Any]] = {
    "priority": priority,
    "tenants": tenants,
    "weights": tenants,
    "timeslice": timeslice,
}

# which sides run which scenario
PLAN: dict[str, tuple[str, ...]] = {
    "priority": ("reference", "loadmaster"),
    "tenants": ("reference", "loadmaster", "loadmaster-fairness-off"),
    "weights": ("loadmaster-weights",),
    "timeslice": ("loadmaster", "loadmaster-timeslice"),
}


# ---- servers ------------------------------------------------------------------------------


def reference(args: argparse.Namespace, log_dir: Path) -> AbstractContextManager[Target]:
    from _llm_servers import reference_server

    return reference_server(args, log_dir)()


@contextmanager
def loadmaster(name: str, overrides: dict[str, Any]) -> Iterator[Target]:
    from loadmaster.cli.launcher import Suite, free_port_overrides

    merged = free_port_overrides()
    merged["model_pool"]["preload"] = ["tiny-chat"]
    merged.update(overrides)
    say(f"[{name}] starting the suite ({overrides or 'the example config'})…")
    with tempfile.TemporaryDirectory(prefix="loadmaster-llm-scheduling-") as logs:
        suite = Suite(EXAMPLE_CONFIG, overrides=merged, log_dir=Path(logs))
        suite.start(timeout_s=120)
        try:
            suite.wait_for_models(["tiny-chat"], timeout_s=120)
            gateway = suite.settings.gateway
            _METRICS[name] = suite.settings.metrics.address
            yield Target(
                name,
                f"http://{gateway.http_host}:{gateway.http_port}/v1",
                "tiny-chat",
                priority_field=True,
                notes=[f"settings: {overrides or 'the example config'}"],
                diagnose=lambda: suite.log_tail("model-pool", 20),
            )
        finally:
            suite.stop()


SIDES: dict[str, dict[str, Any]] = {
    "loadmaster": {},
    "loadmaster-fairness-off": {"generation": {"fairness": False}},
    "loadmaster-weights": {"tenants": {"short": {"weight": 2.0}, "long": {"weight": 1.0}}},
    "loadmaster-timeslice": {"generation": {"timeslice_tokens": 16}},
}


# ---- the run --------------------------------------------------------------------------------


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the issue, met or not, from the results."""
    out: list[dict[str, Any]] = []

    def add(name: str, value: Any, goal: str, met: bool | None) -> None:
        # the shape every bench's targets share (bench/report.py renders them)
        out.append({"name": name, "measured": value, "target": goal, "unit": "", "met": met})

    p_lm = results.get("priority", {}).get("loadmaster") or {}
    p_ref = results.get("priority", {}).get("reference") or {}
    if p_lm.get("ratio_loaded_p99_to_idle_p99") is not None:
        ratio = p_lm["ratio_loaded_p99_to_idle_p99"]
        add("priority-0 TTFT p99 under saturation / idle p99", ratio, "<= 3", ratio <= 3)
        loaded = (p_lm.get("loaded_ttft") or {}).get("p99_ms")
        ref = (p_ref.get("loaded_ttft") or {}).get("p99_ms")
        if loaded is not None and ref is not None:
            add(
                "priority-0 TTFT p99 loaded vs the FIFO reference's (ms)",
                f"{loaded} vs {ref}",
                "below",
                loaded < ref,
            )
        if p_lm.get("aim_ms") is not None and loaded is not None:
            add(
                "aim: p99 <= 1.2 x (idle p50 + one saturated step) (ms)",
                f"{loaded} vs {p_lm['aim_ms']}",
                "<=",
                loaded <= p_lm["aim_ms"],
            )
    t_lm = results.get("tenants", {}).get("loadmaster") or {}
    if t_lm.get("short_share") is not None:
        add("short tenant's share of service", t_lm["short_share"], ">= 0.45", t_lm["short_share"] >= 0.45)
        low = t_lm.get("short_share_min_window")
        add("short tenant's share, every 2 s window (min)", low, ">= 0.35", low is not None and low >= 0.35)
    w = results.get("weights", {}).get("loadmaster-weights") or {}
    if w.get("short_share") is not None:
        add(
            "short tenant's share with weights 2:1",
            w["short_share"],
            "0.67 +- 0.05",
            abs(w["short_share"] - 0.67) <= 0.05,
        )
    return out


def run_side(name: str, scenarios: list[str], args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """Start the side's server (outside any event loop: the suite's start runs one of its own),
    then its scenarios in one loop."""
    server = reference(args, log_dir) if name == "reference" else loadmaster(name, SIDES[name])
    with server as target:
        return asyncio.run(_scenarios(target, scenarios, args))


async def _scenarios(target: Target, scenarios: list[str], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    deadline = time.monotonic() + args.side_budget_s
    client = _client(target)
    try:
        await stream_once(client, target, index=0, tokens=4, priority=0)  # warm
        for scenario in scenarios:
            if time.monotonic() > deadline:
                out[scenario] = {"skipped": f"side budget of {args.side_budget_s:g} s used up"}
                continue
            out[scenario] = await SCENARIOS[scenario](client, target, args)
            out[scenario]["notes"] = target.notes
    finally:
        await client.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", nargs="+", default=list(PLAN), choices=list(PLAN))
    parser.add_argument(
        "--sides", nargs="+", default=None, help="only these sides (default: each scenario's)"
    )
    parser.add_argument("--probes", type=int, default=100)
    parser.add_argument("--fair-s", type=float, default=24.0)
    parser.add_argument("--side-budget-s", type=float, default=400.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reference-threads", type=int, default=1)
    parser.add_argument("--reference-args", default="", help="extra flags for transformers serve")
    args = parser.parse_args()
    if not (MODEL_FOLDER / "config.json").is_file():
        say(f"{MODEL_FOLDER} is missing: run `make models` first")
        return 1
    sides: dict[str, list[str]] = {}
    for scenario in args.scenarios:
        for side in PLAN[scenario]:
            if args.sides is None or side in args.sides:
                sides.setdefault(side, []).append(scenario)
    results: dict[str, dict[str, Any]] = {scenario: {} for scenario in args.scenarios}
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="llm-scheduling-logs-") as folder:
        for side, scenarios in sides.items():
            try:
                outcome = run_side(side, scenarios, args, Path(folder))
            except Exception as error:
                traceback.print_exc()
                failed.append(f"{side}: {type(error).__name__}: {error}")
                continue
            for scenario, value in outcome.items():
                results[scenario][side] = value
    met = targets(results)
    say("\n== targets ==")
    for row in met:
        mark = "met" if row["met"] else ("MISSED" if row["met"] is False else "?")
        say(f"  {mark:6}  {row['name']}: {row['measured']} (target {row['target']})")
    for scenario, by_side in results.items():
        say(f"\n== {scenario} ==")
        for side, value in by_side.items():
            shown = {k: v for k, v in value.items() if k not in ("notes", "short_share_windows")}
            say(f"  {side}: {shown}")
    write_result(
        "llm_scheduling",
        {
            "command": "bench/llm_scheduling.py "
            + shlex.join(
                ["--probes", str(args.probes), "--fair-s", f"{args.fair_s:g}", "--scenarios", *args.scenarios]
            ),
            "results": results,
            "targets": met,
            "failed_sides": failed,
        },
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
