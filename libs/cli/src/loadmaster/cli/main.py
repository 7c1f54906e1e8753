"""The `loadmaster` command."""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from loadmaster.cli import chat_cmd, gpu_cmd, keys_cmd, models_cmd, scheduler_cmd, top_cmd
from loadmaster.cli.launcher import Suite
from loadmaster.cli.status import collect_status
from loadmaster.common.config import load_settings

app = typer.Typer(help="Loadmaster: the inference control plane.", no_args_is_help=True)
app.add_typer(gpu_cmd.app, name="gpu")
app.add_typer(scheduler_cmd.app, name="scheduler")
app.add_typer(keys_cmd.app, name="keys")
app.add_typer(models_cmd.app, name="models")
app.command("top")(top_cmd.top)
app.command("chat")(chat_cmd.chat)
console = Console(stderr=True)

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="loadmaster.yaml (default: built-in defaults)")
]


@app.command()
def up(
    config: ConfigOption = None,
    workers: Annotated[int, typer.Option(min=1, help="model-pool worker processes")] = 1,
) -> None:
    """Start Redis, gpu-broker, metrics, scheduler, model-pool worker(s) and the gateway; Ctrl-C stops all."""
    config_path = config or Path("loadmaster.yaml")
    if not config_path.exists():
        raise typer.BadParameter(f"{config_path} does not exist", param_hint="--config")
    suite = Suite(config_path, workers=workers)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        suite.start(progress=lambda message: console.print(f"[dim]…[/dim] {message}"))
    except (RuntimeError, TimeoutError) as error:
        console.print(f"[red]start failed:[/red] {error}")
        raise typer.Exit(1) from None
    table = Table(title="Loadmaster is up", show_header=False)
    for name, endpoint in suite.endpoints().items():
        table.add_row(name, endpoint)
    console.print(table)
    _print_status(suite.settings)
    console.print("Ctrl-C stops everything.")
    try:
        while not stop.wait(0.5):
            dead = suite.exited()
            if dead:
                for service in dead:
                    console.print(
                        f"[red]{service.name} exited with code {service.process.returncode}[/red]\n"
                        f"{service.log_tail()}"
                    )
                raise typer.Exit(1)
    finally:
        console.print("stopping…")
        suite.stop()
        console.print("stopped.")


@app.command()
def status(config: ConfigOption = None) -> None:
    """Health of every service and the state of each model on each worker."""
    settings = load_settings(config)
    if not _print_status(settings):
        raise typer.Exit(1)


def _print_status(settings: object) -> bool:
    result = asyncio.run(collect_status(settings))  # type: ignore[arg-type]
    services = Table(title="services")
    for column in ("service", "address", "health"):
        services.add_column(column)
    for row in result.services:
        services.add_row(
            row.name, row.address, "[green]SERVING[/green]" if row.serving else "[red]DOWN[/red]"
        )
    console.print(services)
    models = Table(title="models")
    for column in ("worker", "model", "state", "inflight", "device", "vram MB", "error"):
        models.add_column(column)
    for m in result.models:
        models.add_row(m.worker_id, m.model_id, m.state, str(m.inflight), m.device, str(m.vram_mb), m.error)
    console.print(models)
    return result.healthy


if __name__ == "__main__":
    app()
