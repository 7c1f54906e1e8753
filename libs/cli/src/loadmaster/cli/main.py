"""The `loadmaster` command.

Exit codes (every sub-command): 0 done / healthy; 1 a failure (a service or Redis down, no
model READY, a refused request, a service of `up` that failed or had to be killed); 2 a usage
error or something not found (a bad option, a config file that is missing or invalid, an
unknown model, no worker answering). `gpu lease` adds its own (see its help).

`--config` defaults to `$LOADMASTER_CONFIG` on every command; with neither, the built-in
defaults apply.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from importlib import metadata
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from loadmaster.cli import (
    chat_cmd,
    config_cmd,
    gpu_cmd,
    guardrails_cmd,
    keys_cmd,
    models_cmd,
    scheduler_cmd,
    top_cmd,
)
from loadmaster.cli._auth import use_credentials
from loadmaster.cli._config import EXIT_FAILURE, ConfigOption, config_problem, settings_from
from loadmaster.cli._output import print_json, stdout_console
from loadmaster.cli.launcher import Suite
from loadmaster.cli.run_state import read_run_state, remove_run_state, run_state_path, write_run_state
from loadmaster.cli.status import SuiteStatus, collect_status, redact
from loadmaster.cli.supervisor import RestartPolicy, supervise
from loadmaster.common.config import ConfigError, Settings

app = typer.Typer(help="Loadmaster: the inference control plane.", no_args_is_help=True)
app.add_typer(gpu_cmd.app, name="gpu")
app.add_typer(scheduler_cmd.app, name="scheduler")
app.add_typer(keys_cmd.app, name="keys")
app.add_typer(models_cmd.app, name="models")
app.add_typer(guardrails_cmd.app, name="guardrails")
app.add_typer(config_cmd.app, name="config")
app.command("top")(top_cmd.top)
app.command("chat")(chat_cmd.chat)
console = Console(stderr=True)


def _version() -> str:
    try:
        return metadata.version("loadmaster-cli")
    except metadata.PackageNotFoundError:
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"loadmaster {_version()}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="print the version and exit"),
    ] = False,
) -> None:
    """Loadmaster: the inference control plane."""


@app.command()
def up(
    config: ConfigOption = None,
    workers: Annotated[int, typer.Option(min=1, help="model-pool worker processes")] = 1,
    max_restarts: Annotated[
        int, typer.Option(min=0, help="restarts allowed per process within --restart-window")
    ] = 5,
    restart_window_s: Annotated[
        float, typer.Option("--restart-window", min=1, help="seconds the restart budget covers")
    ] = 60.0,
    as_json: Annotated[
        bool, typer.Option("--json", help="once up, print the endpoints and status as JSON on stdout")
    ] = False,
) -> None:
    """Start Redis, gpu-broker, metrics, scheduler, model-pool worker(s) and the gateway; restart any
    that crashes (within a budget, else stop all and exit 1); Ctrl-C or SIGTERM stops all, in
    dependency order (gateway, workers, scheduler, broker, metrics, Redis), each drained within
    its shutdown_grace_s. Exits 1 when a service failed or did not stop cleanly."""
    try:
        suite = Suite(config, workers=workers, make_credentials=True, persist_redis=True)
    except ConfigError as error:
        raise config_problem(error) from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        suite.start(progress=lambda message: console.print(f"[dim]…[/dim] {message}"))
    except (RuntimeError, TimeoutError) as error:
        console.print(f"[red]start failed:[/red] {error}")
        raise typer.Exit(1) from None
    endpoints = {name: redact(endpoint) for name, endpoint in suite.endpoints().items()}
    state_path = run_state_path(suite.settings.gateway.address)
    try:
        write_run_state(
            state_path,
            {
                "pid": os.getpid(),
                "redis_url": suite.settings.redis_url,
                "internal_auth": suite.credential_files,
            },
        )
    except OSError as error:  # status then needs REDIS_URL to find this suite's Redis
        console.print(f"[yellow]run state not written:[/yellow] {error}")
    table = Table(title="Loadmaster is up", show_header=False)
    for name, endpoint in endpoints.items():
        table.add_row(name, endpoint)
    console.print(table)
    use_credentials(suite.settings)
    result = _print_status(suite.settings, console)
    if as_json:
        print_json({"endpoints": endpoints, "status": result.to_json()})
    console.print("Ctrl-C stops everything.")
    policy = RestartPolicy(max_restarts=max_restarts, window_s=restart_window_s)
    supervised = EXIT_FAILURE
    try:
        supervised = supervise(suite, stop, console.print, policy=policy)
    finally:
        console.print("stopping…")
        failed = suite.stop(progress=console.print)
        remove_run_state(state_path)
        console.print("stopped." if not failed else f"[red]stopped; failed: {', '.join(failed)}[/red]")
    if supervised != 0 or failed:
        raise typer.Exit(EXIT_FAILURE)


@app.command()
def status(
    config: ConfigOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON for scripts")] = False,
) -> None:
    """Redis, the health of every service and the state of each model on each worker.

    Every worker the scheduler knows is listed (its ListWorkers), each checked on its own
    gRPC address. Exit codes: 0 healthy (Redis answers, every service SERVING, a model READY);
    1 not; 2 usage (e.g. the config file does not exist or is invalid). Redis is found through
    REDIS_URL (or the config's redis_url), else through the running `loadmaster up` of this
    gateway address.
    """
    settings = settings_from(config)
    if not settings.redis_url:
        known = read_run_state(run_state_path(settings.gateway.address)).get("redis_url")
        if isinstance(known, str) and known:
            settings = settings.model_copy(update={"redis_url": known})
    use_credentials(settings)
    if as_json:
        result = asyncio.run(collect_status(settings, check_redis=True))
        print_json(result.to_json())
    else:
        result = _print_status(settings, stdout_console())
    if not result.ok:
        raise typer.Exit(1)


def _print_status(settings: Settings, out: Console) -> SuiteStatus:
    result = asyncio.run(collect_status(settings, check_redis=True))
    if result.redis is not None:
        health = "[green]UP[/green]" if result.redis.reachable else f"[red]DOWN[/red] {result.redis.error}"
        out.print(f"redis {result.redis.url}: {health}")
    services = Table(title="services")
    for column in ("service", "address", "health"):
        services.add_column(column)
    for row in result.services:
        services.add_row(
            row.name, row.address, "[green]SERVING[/green]" if row.serving else "[red]DOWN[/red]"
        )
    out.print(services)
    models = Table(title="models")
    for column in ("worker", "model", "state", "inflight", "device", "vram MB", "error"):
        models.add_column(column)
    for m in result.models:
        models.add_row(m.worker_id, m.model_id, m.state, str(m.inflight), m.device, str(m.vram_mb), m.error)
    out.print(models)
    for problem in result.problems:
        out.print(f"[red]problem:[/red] {problem}")
    return result


if __name__ == "__main__":
    app()
