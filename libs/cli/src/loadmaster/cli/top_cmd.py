"""`loadmaster top`: the dashboard at a glance in the terminal, refreshed live.

Reads the metrics service's dashboard document (`GET /api/dashboard` on its HTTP port, the
same data the web dashboard plots): per model latency percentiles, throughput, queue depth,
deadline misses and errors over the last seconds, with a throughput trend; for each generative
model, output tokens/s and time to first token (p50, p95) with a tokens/s trend; memory leased
per GPU; the state of each model on each worker.

    loadmaster top -c loadmaster.yaml                 # live until Ctrl-C
    loadmaster top -c loadmaster.yaml --once          # one frame, then exit (scripts, tests)
    loadmaster top -c loadmaster.yaml --iterations 5  # five refreshes, then exit
    loadmaster top -c loadmaster.yaml --json          # the dashboard document once, as JSON

Exit codes: 0 shown; 1 the metrics service could not be reached (`--once`, `--json`).
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from typing import Annotated, Any

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from loadmaster.cli._config import ConfigOption, settings_from
from loadmaster.cli._output import print_json, stdout_console
from loadmaster.common.config import Settings

__all__ = ["fetch_dashboard", "render", "top"]

_SPARKS = "▁▂▃▄▅▆▇█"
_STATE_STYLE = {"READY": "green", "LOADING": "yellow", "UNLOADING": "yellow", "FAILED": "red"}


def dashboard_url(settings: Settings, *, window_s: float, summary_s: float) -> str:
    host = settings.metrics.http_host
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return (
        f"http://{host}:{settings.metrics.http_port}/api/dashboard"
        f"?window_s={window_s:g}&step_s=1&summary_s={summary_s:g}"
    )


def fetch_dashboard(url: str, *, timeout_s: float = 2.0, api_key: str = "") -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def sparkline(values: list[float | None], width: int = 30) -> str:
    tail = values[-width:]
    numbers = [v for v in tail if v is not None]
    top = max(numbers, default=0.0)
    if top <= 0:
        return _SPARKS[0] * len(tail)
    return "".join(" " if v is None else _SPARKS[min(7, int(v / top * 7.999))] for v in tail)


def _num(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.{digits}f}"


def render(doc: dict[str, Any], *, source: str = "", expand: bool = True) -> Group:
    """One frame of `top` from the dashboard document (`expand`: tables fill the width)."""
    models = Table(title=f"models (last {_num(doc.get('summary_s'))} s)", expand=expand)
    for column in ("model", "p50 ms", "p95 ms", "p99 ms", "req/s", "queue", "deadline misses", "errors"):
        models.add_column(column, justify="left" if column == "model" else "right")
    models.add_column(f"req/s, last {min(30, len(doc.get('t', [])))} s")
    for name, model in doc.get("models", {}).items():
        s = model["summary"]
        misses = s.get("deadline_misses") or 0
        models.add_row(
            name,
            _num(s.get("p50_ms"), 2),
            _num(s.get("p95_ms"), 2),
            _num(s.get("p99_ms"), 2),
            _num(s.get("throughput_rps")),
            _num(s.get("queue_depth")),
            Text(_num(misses), style="red" if misses else ""),
            _num(s.get("errors")),
            Text(sparkline(model.get("throughput_rps", [])), style="cyan"),
        )

    generative = _generative_table(doc, expand=expand)

    gpus = Table(title="GPU memory", expand=expand)
    for column in ("gpu", "leased MB", "free MB", "leased, trend"):
        gpus.add_column(column, justify="left" if column in ("gpu", "leased, trend") else "right")
    for name, gpu in doc.get("gpus", {}).items():
        gpus.add_row(
            name,
            _num(gpu.get("lease_mb_now")),
            _num(gpu.get("free_mb_now")),
            Text(sparkline(gpu.get("lease_mb", [])), style="magenta"),
        )

    workers = Table(title="model states per worker", expand=expand)
    for column in ("worker", "model", "state", "inflight", "VRAM MB"):
        workers.add_column(column, justify="right" if column in ("inflight", "VRAM MB") else "left")
    for worker in doc.get("workers", []):
        for slot in worker["slots"]:
            state = slot["state"]
            workers.add_row(
                worker["worker_id"],
                slot["model"],
                Text(state, style=_STATE_STYLE.get(state, "dim")),
                str(slot["inflight"]),
                str(slot["vram_mb"]),
            )
    header = Text.assemble(("loadmaster top", "bold"), "  ", (source, "dim"))
    scheduling = _scheduling_table(doc, expand=expand)
    tables = [models, *(t for t in (generative, scheduling) if t is not None), gpus, workers]
    return Group(header, *tables)


def _generative_table(doc: dict[str, Any], *, expand: bool) -> Table | None:
    """Tokens/s and time to first token per generative model (`generative` in the document);
    None when no model generates text."""
    served = doc.get("generative") or {}
    if not served:
        return None
    table = Table(title=f"generative models (last {_num(doc.get('summary_s'))} s)", expand=expand)
    for column in ("model", "tokens/s", "TTFT p50 ms", "TTFT p95 ms"):
        table.add_column(column, justify="left" if column == "model" else "right")
    table.add_column(f"tokens/s, last {min(30, len(doc.get('t', [])))} s")
    for name, model in served.items():
        s = model.get("summary") or {}
        table.add_row(
            name,
            _num(s.get("tokens_per_s")),
            _num(s.get("ttft_p50_ms"), 2),
            _num(s.get("ttft_p95_ms"), 2),
            Text(sparkline(model.get("tokens_per_s", [])), style="green"),
        )
    return table


def _scheduling_table(doc: dict[str, Any], *, expand: bool) -> Table | None:
    """How each generative model's queue ordered its work (docs/generation-scheduling.md):
    the wait to a first token per priority, pauses and their KV cache, tokens/s per tenant
    and the largest gap between backlogged tenants' counters; None when nothing generated."""
    served = doc.get("generative") or {}
    rows = [(name, model.get("summary") or {}) for name, model in served.items()]
    rows = [(name, s) for name, s in rows if s.get("tenants") or s.get("wait_to_first_token_by_priority")]
    if not rows:
        return None
    table = Table(title="generation scheduling", expand=expand)
    for column in (
        "model",
        "wait to 1st token p50/p95 ms by priority",
        "preempt/yield/resume",
        "KV kept/recomputed",
        "tokens/s by tenant",
        "counter gap",
    ):
        table.add_column(column, justify="left" if column in ("model", "tokens/s by tenant") else "right")
    for name, s in rows:
        waits = s.get("wait_to_first_token_by_priority") or {}
        tenants = s.get("tenants") or {}
        table.add_row(
            name,
            " ".join(f"p{p}:{_num(w.get('p50_ms'))}/{_num(w.get('p95_ms'))}" for p, w in waits.items())
            or "-",
            f"{s.get('preemptions', 0)}/{s.get('yields', 0)}/{s.get('resumptions', 0)}",
            f"{s.get('kv_kept', 0)}/{s.get('kv_recomputed', 0)}",
            " ".join(f"{t}:{_num(v.get('output_tokens_per_s'))}" for t, v in tenants.items()) or "-",
            _num(s.get("tenant_counter_gap")),
        )
    return table


def _frame(url: str, *, expand: bool = True, api_key: str = "") -> Group | Text:
    try:
        return render(fetch_dashboard(url, api_key=api_key), source=url.split("/api/", 1)[0], expand=expand)
    except (urllib.error.URLError, OSError, ValueError) as error:
        return Text(f"metrics service unreachable at {url}: {error}", style="red")


def top(
    config: ConfigOption = None,
    once: Annotated[bool, typer.Option("--once", help="print one frame and exit")] = False,
    iterations: Annotated[
        int,
        typer.Option("--iterations", "-n", min=0, help="stop after this many refreshes (0 = until Ctrl-C)"),
    ] = 0,
    interval_s: Annotated[float, typer.Option("--interval", min=0.1, help="seconds between refreshes")] = 1.0,
    window_s: Annotated[
        float, typer.Option("--window", min=1, help="seconds of history in the trends")
    ] = 60.0,
    summary_s: Annotated[float, typer.Option("--summary", min=1, help="seconds the figures cover")] = 10.0,
    as_json: Annotated[
        bool, typer.Option("--json", help="print the dashboard document once, as JSON")
    ] = False,
    api_key: Annotated[
        str,
        typer.Option(
            "--api-key", envvar="LOADMASTER_API_KEY", help="a gateway API key, when the dashboard needs one"
        ),
    ] = "",
) -> None:
    """Latency, throughput, queues, deadline misses, GPU memory and model states, refreshed live."""
    settings = settings_from(config)
    url = dashboard_url(settings, window_s=window_s, summary_s=summary_s)
    if as_json:
        try:
            document = fetch_dashboard(url, api_key=api_key)
        except (urllib.error.URLError, OSError, ValueError) as error:
            Console(stderr=True).print(f"[red]metrics service unreachable at {url}: {error}[/red]")
            raise typer.Exit(1) from None
        print_json(document)
        return
    console = stdout_console()
    expand = console.is_terminal  # piped: tables as wide as their content, not PIPE_WIDTH
    if once:
        frame = _frame(url, expand=expand, api_key=api_key)
        console.print(frame)
        if isinstance(frame, Text):
            raise typer.Exit(1)
        return
    stop = threading.Event()
    count = 0
    try:
        with Live(
            _frame(url, expand=expand, api_key=api_key), console=console, refresh_per_second=4, screen=False
        ) as live:
            count = 1
            while not (iterations and count >= iterations) and not stop.wait(interval_s):
                live.update(_frame(url, expand=expand, api_key=api_key))
                count += 1
    except KeyboardInterrupt:
        pass
