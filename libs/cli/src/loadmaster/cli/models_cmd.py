"""`loadmaster models list | load NAME | unload NAME | pin NAME [--off]`: the model-pool's admin API.

Workers are found through the scheduler (`ListWorkers`: each worker's gRPC endpoint);
when the scheduler cannot be reached, `model_pool.address` of the config is used, or
`--worker host:port` names one worker. `list` shows every worker's slots (state,
device, memory, batching, last use, in flight, evictions); `load` / `unload` / `pin`
go to the worker that holds the model (load: the one given, else the first that has
it in its repository). Each change reaches the scheduler's placement through the
worker's next report. `pin` is also stored through the gateway's admin API (as the runtime
setting `models.known.NAME.pin`), so every worker, and every worker started later, holds the
model pinned (docs/admin.md); with `--worker` only that worker is asked and nothing is stored.

`list --json` prints `{"workers": [{"endpoint", "worker_id", "free_mb", "evictions",
"models": [{"model_id", "state", ...}]}]}` for scripts.

Exit codes: 0 done, 1 the worker refused (the message says why), 2 no worker found, or no
worker has the model (`load`, `unload` and `pin` alike).
"""

from __future__ import annotations

import time
from typing import Annotated

import grpc
import typer
from rich.console import Console
from rich.table import Table

from loadmaster.cli._auth import use_credentials
from loadmaster.cli._config import ConfigOption, settings_from
from loadmaster.cli._output import print_json, stdout_console
from loadmaster.cli.admin_client import AdminError, ApiKeyOption, GatewayOption, admin_client, fail
from loadmaster.common import internal_auth
from loadmaster.common.config import Settings
from loadmaster.common.errors import LoadmasterError, from_grpc_error
from loadmaster.v1 import model_pool_pb2 as pb
from loadmaster.v1 import model_pool_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

__all__ = ["app", "worker_endpoints"]

app = typer.Typer(help="Models on the model-pool workers: list, load, unload, pin.", no_args_is_help=True)
console = stdout_console()
errors = Console(stderr=True)

WorkerOption = Annotated[
    str | None,
    typer.Option("--worker", "-w", help="one worker's gRPC address (default: all, via the scheduler)"),
]
_TIMEOUT_S = 5.0
_LOAD_TIMEOUT_S = 300.0


def worker_endpoints(settings: Settings, worker: str | None = None) -> list[str]:
    """The workers' gRPC endpoints: `worker`, else the scheduler's ListWorkers, else model_pool.address."""
    if worker:
        return [worker]
    try:
        with internal_auth.sync_channel(settings.scheduler.address) as channel:
            reply = scheduler_pb2_grpc.SchedulerServiceStub(channel).ListWorkers(
                scheduler_pb2.ListWorkersRequest(), timeout=_TIMEOUT_S
            )
        endpoints = [w.grpc_endpoint for w in reply.workers if w.grpc_endpoint]
        if endpoints:
            return endpoints
    except grpc.RpcError:
        pass
    return [settings.model_pool.address]


def _status(endpoint: str) -> pb.StatusResponse:
    with internal_auth.sync_channel(endpoint) as channel:
        return model_pool_pb2_grpc.ModelPoolServiceStub(channel).Status(
            pb.StatusRequest(), timeout=_TIMEOUT_S
        )


def _statuses(endpoints: list[str]) -> list[tuple[str, pb.StatusResponse]]:
    out = []
    for endpoint in endpoints:
        try:
            out.append((endpoint, _status(endpoint)))
        except grpc.RpcError as error:
            errors.print(f"[yellow]{endpoint}: {from_grpc_error(error).message}[/yellow]")
    if not out:
        errors.print("[red]no model-pool worker answered[/red]")
        raise typer.Exit(2)
    return out


def _ago(unix_ms: int) -> str:
    if not unix_ms:
        return "-"
    seconds = max(0.0, time.time() - unix_ms / 1000.0)
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def _state(value: int) -> str:
    return pb.ModelState.Name(value).removeprefix("MODEL_STATE_")


def _slot_json(m: pb.ModelSlotStatus) -> dict[str, object]:
    return {
        "model_id": m.model_id,
        "state": _state(m.state),
        "generation": m.generation,
        "device": m.device,
        "vram_mb": m.vram_mb,
        "max_batch_size": m.max_batch_size or 1,
        "instances": m.instances or 1,
        "inflight": m.inflight,
        "max_inflight": m.max_inflight,
        "last_used_unix_ms": m.last_used_unix_ms,
        "pinned": m.pinned,
        "priority": m.priority,
        "evictions": m.evictions,
        "error": m.error,
    }


@app.command("list")
def list_models(
    config: ConfigOption = None,
    worker: WorkerOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON for scripts")] = False,
) -> None:
    """Every model slot on every worker."""
    settings = settings_from(config)
    use_credentials(settings)
    found = _statuses(worker_endpoints(settings, worker))
    if as_json:
        print_json(
            {
                "workers": [
                    {
                        "endpoint": endpoint,
                        "worker_id": status.worker_id,
                        "free_mb": status.free_mb,
                        "evictions": dict(sorted(status.evictions.items())),
                        "models": [_slot_json(m) for m in status.models],
                    }
                    for endpoint, status in found
                ]
            }
        )
        return
    table = Table(title="models")
    for column in (
        "worker", "model", "state", "gen", "device", "MB", "batch", "inst", "in flight", "last use",
        "pinned", "prio", "evicted", "error",
    ):  # fmt: skip
        table.add_column(column)
    for endpoint, status in found:
        for m in status.models:
            table.add_row(
                status.worker_id or endpoint,
                m.model_id,
                _state(m.state),
                str(m.generation),
                m.device or "-",
                str(m.vram_mb) if m.vram_mb else "-",
                str(m.max_batch_size or 1),
                str(m.instances or 1),
                f"{m.inflight}/{m.max_inflight}",
                _ago(m.last_used_unix_ms),
                "yes" if m.pinned else "",
                str(m.priority),
                str(m.evictions),
                m.error[:60],
            )
        evictions = ", ".join(f"{k}={v}" for k, v in sorted(status.evictions.items())) or "none"
        table.caption = f"free (evictable) {status.free_mb} MB; evictions: {evictions}"
    console.print(table)


def _holder(settings: Settings, model_id: str, worker: str | None, *, loaded: bool) -> list[str]:
    """Workers to act on: those holding the model (loaded=True) or the first that can load it."""
    found = _statuses(worker_endpoints(settings, worker))
    if worker:
        return [worker]
    holding = [
        endpoint
        for endpoint, status in found
        for m in status.models
        if m.model_id == model_id and m.state != pb.MODEL_STATE_IDLE
    ]
    if holding:
        return holding
    can = [endpoint for endpoint, status in found if model_id in status.repository]
    if loaded and can:
        return can
    if not can:
        errors.print(f"[red]no worker has model {model_id!r} in its repository[/red]")
        raise typer.Exit(2)
    return can[:1]


def _call(endpoint: str, method: str, request: object, timeout_s: float) -> pb.ModelSlotStatus:
    with internal_auth.sync_channel(endpoint) as channel:
        stub = model_pool_pb2_grpc.ModelPoolServiceStub(channel)
        try:
            reply = getattr(stub, method)(request, timeout=timeout_s)
        except grpc.RpcError as error:
            mapped: LoadmasterError = from_grpc_error(error)
            errors.print(f"[red]{endpoint}: {mapped.message}[/red]")
            raise typer.Exit(1) from None
    return reply.model


def _say(endpoint: str, m: pb.ModelSlotStatus) -> None:
    pinned = ", pinned" if m.pinned else ""
    console.print(f"{m.model_id} on {endpoint}: {_state(m.state)} (generation {m.generation}{pinned})")


@app.command()
def load(model: str, config: ConfigOption = None, worker: WorkerOption = None) -> None:
    """Load MODEL (evicting idle models when its lease does not fit)."""
    settings = settings_from(config)
    use_credentials(settings)
    for endpoint in _holder(settings, model, worker, loaded=False):
        _say(endpoint, _call(endpoint, "Load", pb.LoadRequest(model_id=model), _LOAD_TIMEOUT_S))


@app.command()
def unload(model: str, config: ConfigOption = None, worker: WorkerOption = None) -> None:
    """Drain and unload MODEL on every worker that holds it."""
    settings = settings_from(config)
    use_credentials(settings)
    for endpoint in _holder(settings, model, worker, loaded=True):
        _say(endpoint, _call(endpoint, "Unload", pb.UnloadRequest(model_id=model), _LOAD_TIMEOUT_S))


@app.command()
def pin(
    model: str,
    config: ConfigOption = None,
    worker: WorkerOption = None,
    off: Annotated[bool, typer.Option("--off", help="unpin instead")] = False,
    gateway: GatewayOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Pin MODEL (never evicted, never unloaded when idle) on the workers that hold it or can
    load it, and store the pin so it holds across restarts."""
    settings = settings_from(config)
    use_credentials(settings)
    holders = _holder(settings, model, worker, loaded=True)
    if worker is None:
        with admin_client(config, gateway, api_key) as client:
            try:
                client.call(
                    "PUT", "/admin/v1/config", body={"key": f"models.known.{model}.pin", "value": not off}
                )
            except AdminError as error:
                if error.status not in (0, 503):
                    raise fail(error) from None
                errors.print(
                    f"pin not stored (it lasts until the worker restarts): {error.message}",
                    style="yellow",
                    markup=False,
                )
    for endpoint in holders:
        _say(endpoint, _call(endpoint, "Pin", pb.PinRequest(model_id=model, pinned=not off), _TIMEOUT_S))
