"""`loadmaster scheduler use NAME [--policy P]` and `loadmaster scheduler queues`.

`use` switches the running scheduler's ordering strategy: waiting requests move to the new
queues, none is lost. It goes through the gateway's admin API, which makes the switch on the
scheduler (the `SetStrategy` admin RPC) and stores it, so it holds across restarts
(docs/admin.md); with `--address`, or when no gateway answers, it asks that scheduler
directly and nothing is stored. `queues` prints each model's
queue (depth, in flight, granted, expired, overflowed, superseded, dropped); `--json`
prints `{"strategy", "policy", "active_clients", "queues": [{"model_id", "depth", ...}]}`.
"""

from __future__ import annotations

from pathlib import Path
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
from loadmaster.v1 import scheduler_pb2, scheduler_pb2_grpc

__all__ = ["app"]

app = typer.Typer(help="The scheduler: strategy and queues.", no_args_is_help=True)
console = Console(stderr=True)

AddressOption = Annotated[
    str | None,
    typer.Option("--address", help="scheduler address (default: scheduler.address of the config)"),
]
_TIMEOUT_S = 10.0


def _address(config: Path | None, address: str | None) -> str:
    settings = settings_from(config)
    use_credentials(settings)
    return address or settings.scheduler.address


def _fail(exc: grpc.RpcError, address: str) -> typer.Exit:
    code = exc.code()  # type: ignore[attr-defined]
    console.print(f"[red]scheduler at {address}: {code.name}: {exc.details()}[/red]")  # type: ignore[attr-defined]
    return typer.Exit(2 if code is grpc.StatusCode.INVALID_ARGUMENT else 1)


@app.command()
def use(
    name: Annotated[
        str,
        typer.Argument(
            help="model_deadline | deadline_aware | tiered_deadline | batch_optimized | "
            "priority_tiered | round_robin"
        ),
    ],
    policy: Annotated[
        str | None, typer.Option("--policy", help="a registered policy (deadline family only)")
    ] = None,
    config: ConfigOption = None,
    address: AddressOption = None,
    gateway: GatewayOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Switch the scheduler's strategy (stored: it holds across restarts); waiting requests move over."""
    suffix = f" (policy {policy})" if policy else ""
    if address is None:
        with admin_client(config, gateway, api_key) as client:
            try:
                switched = client.call(
                    "POST", "/admin/v1/strategy", body={"strategy": name, "policy": policy or ""}
                )
            except AdminError as error:
                if error.status != 0:
                    raise fail(error) from None
                console.print(
                    f"{error.message}; asking the scheduler directly (not stored)",
                    style="yellow",
                    markup=False,
                )
            else:
                stored = "" if switched["persisted"] else " (not stored: the gateway has no Redis)"
                typer.echo(
                    f"strategy {switched['previous']} -> {switched['strategy']}{suffix}; "
                    f"{switched['moved']} waiting requests moved{stored}"
                )
                return
    target = _address(config, address)
    with internal_auth.sync_channel(target) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        try:
            reply = stub.SetStrategy(
                scheduler_pb2.SetStrategyRequest(strategy=name, policy=policy or ""), timeout=_TIMEOUT_S
            )
        except grpc.RpcError as exc:
            raise _fail(exc, target) from None
    typer.echo(f"strategy {reply.previous} -> {reply.strategy}{suffix}; {reply.moved} waiting requests moved")


@app.command()
def queues(
    config: ConfigOption = None,
    address: AddressOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON for scripts")] = False,
) -> None:
    """Print the scheduler's strategy and per-model queues."""
    target = _address(config, address)
    with internal_auth.sync_channel(target) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        try:
            reply = stub.GetQueues(scheduler_pb2.GetQueuesRequest(), timeout=_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise _fail(exc, target) from None
    if as_json:
        print_json(
            {
                "strategy": reply.strategy,
                "policy": reply.policy,
                "active_clients": reply.active_clients,
                "queues": [
                    {
                        "model_id": q.model_id,
                        "depth": q.depth,
                        "inflight": q.inflight,
                        "credits": q.credits,
                        "granted": q.granted,
                        "expired": q.expired,
                        "overflowed": q.overflowed,
                        "superseded": q.superseded,
                        "dropped": q.dropped,
                    }
                    for q in reply.queues
                ],
            }
        )
        return
    policy = f", policy {reply.policy}" if reply.policy else ""
    table = Table(title=f"strategy {reply.strategy}{policy}; {reply.active_clients} active clients")
    columns = (
        "model",
        "depth",
        "inflight",
        "credits",
        "granted",
        "expired",
        "overflowed",
        "superseded",
        "dropped",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "model" else "right")
    for q in reply.queues:
        table.add_row(
            q.model_id,
            *(
                str(v)
                for v in (
                    q.depth,
                    q.inflight,
                    q.credits,
                    q.granted,
                    q.expired,
                    q.overflowed,
                    q.superseded,
                    q.dropped,
                )
            ),
        )
    stdout_console().print(table)
