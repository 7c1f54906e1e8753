"""`loadmaster gpu status` and `loadmaster gpu lease --mb N -- COMMAND…`.

`gpu lease` holds a broker lease (the client library's `GpuLease`) while COMMAND runs:
renewed in the background, exported to the command as CUDA_VISIBLE_DEVICES (with
CUDA_DEVICE_ORDER=PCI_BUS_ID, so CUDA numbers GPUs as NVML and the broker do) and
LOADMASTER_GPU_LEASE_ID / LOADMASTER_GPU_FENCING_TOKEN, and released when the command exits,
crashes, or is interrupted (Ctrl-C and SIGTERM are passed on to the command, then the lease
is released). If the lease is lost while the command runs, the command is terminated.

Exit codes: the command's own (128 + N when a signal N ended it); 1 when no lease was granted
(the message says how much memory is free); 3 when the lease was lost; 127 when COMMAND
cannot be started.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import grpc
import typer
from rich.console import Console
from rich.table import Table

from loadmaster.cli._auth import use_credentials
from loadmaster.cli._config import ConfigOption, settings_from
from loadmaster.cli._output import stdout_console
from loadmaster.client.gpu_lease import GpuLease
from loadmaster.common import internal_auth
from loadmaster.common.child_processes import die_with_parent
from loadmaster.common.child_processes import signal_group as _signal_group
from loadmaster.common.errors import LoadmasterError, from_grpc_error
from loadmaster.v1 import gpu_broker_pb2 as pb
from loadmaster.v1 import gpu_broker_pb2_grpc

__all__ = ["EXIT_LEASE_LOST", "EXIT_NO_LEASE", "app"]

EXIT_NO_LEASE = 1
EXIT_LEASE_LOST = 3
_EXIT_NOT_STARTED = 127
_KILL_GRACE_S = 10.0

app = typer.Typer(
    help="GPU memory leases: inventory, and running commands under a lease.", no_args_is_help=True
)
console = Console(stderr=True)

BrokerOption = Annotated[
    str | None,
    typer.Option("--broker", help="gpu-broker address (default: gpu_broker.address of the config)"),
]


def _address(config: Path | None, broker: str | None) -> str:
    settings = settings_from(config)
    use_credentials(settings)
    return broker or settings.gpu_broker.address


def _gpu_json(gpu: pb.Gpu) -> dict[str, Any]:
    return {
        "node": gpu.node,
        "index": gpu.index,
        "name": gpu.name,
        "uuid": gpu.uuid,
        "total_mb": gpu.total_mb,
        "reserve_mb": gpu.reserve_mb,
        "leased_mb": gpu.leased_mb,
        "used_outside_mb": gpu.used_outside_mb,
        "free_mb": gpu.free_mb,
    }


def _lease_json(lease: pb.Lease) -> dict[str, Any]:
    return {
        "lease_id": lease.lease_id,
        "holder": lease.holder,
        "node": lease.node,
        "mb_per_gpu": {str(index): mb for index, mb in sorted(lease.mb_per_gpu.items())},
        "labels": dict(lease.labels),
        "created_unix_ms": lease.created_unix_ms,
        "expires_unix_ms": lease.expires_unix_ms,
        "fencing_token": lease.fencing_token,
    }


@app.command()
def status(
    config: ConfigOption = None,
    broker: BrokerOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON for scripts")] = False,
    node: Annotated[str, typer.Option(help="only this node")] = "",
) -> None:
    """Per GPU: total, reserved, leased, used outside leases, free; and the live leases."""
    address = _address(config, broker)
    try:
        with internal_auth.sync_channel(address) as channel:
            stub = gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel)
            gpus = stub.Inventory(pb.InventoryRequest(node=node), timeout=5).gpus
            leases = stub.ListLeases(pb.ListLeasesRequest(node=node), timeout=5).leases
    except grpc.RpcError as raw:
        console.print(f"[red]gpu-broker at {address}:[/red] {from_grpc_error(raw)}")
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(
            json.dumps({"gpus": [_gpu_json(g) for g in gpus], "leases": [_lease_json(x) for x in leases]})
        )
        return
    out = stdout_console()
    table = Table(title=f"GPUs ({address})")
    for column in ("node", "gpu", "name", "total MB", "reserved MB", "leased MB", "outside MB", "free MB"):
        table.add_column(column, justify="right" if "MB" in column else "left")
    for g in gpus:
        table.add_row(
            g.node,
            str(g.index),
            g.name,
            str(g.total_mb),
            str(g.reserve_mb),
            str(g.leased_mb),
            str(g.used_outside_mb),
            f"[bold]{g.free_mb}[/bold]",
        )
    out.print(table)
    now_ms = time.time() * 1000
    held = Table(title=f"leases ({len(leases)})")
    for column in ("lease", "holder", "node", "MB per GPU", "expires in", "token", "labels"):
        held.add_column(column)
    for lease in leases:
        held.add_row(
            lease.lease_id[:12],
            lease.holder,
            lease.node,
            ", ".join(f"{i}: {mb}" for i, mb in sorted(lease.mb_per_gpu.items())),
            f"{max(0.0, (lease.expires_unix_ms - now_ms) / 1000):.1f} s",
            str(lease.fencing_token),
            " ".join(f"{k}={v}" for k, v in sorted(lease.labels.items())),
        )
    out.print(held)


def _parse_gpus(text: str) -> list[int]:
    try:
        gpus = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(
            f"expected GPU indexes like 0,1 — got {text!r}", param_hint="--gpus"
        ) from None
    if any(g < 0 for g in gpus):
        raise typer.BadParameter("GPU indexes are >= 0", param_hint="--gpus")
    return gpus


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


@app.command(context_settings={"ignore_unknown_options": True})
def lease(
    command: Annotated[list[str], typer.Argument(help="the command to run under the lease (after --)")],
    mb: Annotated[int, typer.Option("--mb", min=1, help="MB of GPU memory")],
    gpus: Annotated[
        str, typer.Option("--gpus", help="GPU indexes to use, e.g. 0,1 (default: best fit)")
    ] = "",
    node: Annotated[
        str, typer.Option(help="node of the GPUs (required with --gpus when several nodes)")
    ] = "",
    ttl: Annotated[
        float, typer.Option("--ttl", min=0.1, help="lease TTL in seconds (renewed every TTL/3)")
    ] = 30.0,
    wait: Annotated[float, typer.Option("--wait", min=0, help="wait up to S seconds for memory")] = 0.0,
    priority: Annotated[int, typer.Option(min=0, max=999, help="order among waiting requests")] = 0,
    split: Annotated[bool, typer.Option("--split", help="allow spreading mb over GPUs of one node")] = False,
    config: ConfigOption = None,
    broker: BrokerOption = None,
) -> None:
    """Run COMMAND under a GPU memory lease: `loadmaster gpu lease --mb 8000 -- python train.py`."""
    address = _address(config, broker)
    indexes = _parse_gpus(gpus)
    if indexes and not node:
        node = settings_from(config).gpu_broker.node
    process: subprocess.Popen[bytes] | None = None
    lost = threading.Event()

    def on_lost(error: LoadmasterError) -> None:
        lost.set()
        console.print(f"[red]lease lost, stopping the command:[/red] {error}")
        if process is not None:
            _stop(process)

    held = GpuLease(
        mb,
        address=address,
        gpus=indexes,
        node=node,
        ttl_s=ttl,
        wait_s=wait,
        priority=priority,
        allow_split=split,
        labels={"command": shlex.join(command)[:200]},
        on_lost=on_lost,
    )
    previous: dict[int, Any] = {}
    interrupted: list[int] = []
    holding = threading.Event()

    def forward(sig: int, frame: FrameType | None) -> None:
        if process is not None:
            _signal_group(process, sig)
            return
        interrupted.append(sig)  # held, command not started yet: do not start it
        if not holding.is_set():
            # Still acquiring (maybe waiting): give up. GpuLease.acquire releases a grant
            # that was in flight before it re-raises.
            raise KeyboardInterrupt

    for forwarded in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        previous[forwarded] = signal.signal(forwarded, forward)
    try:
        held.acquire()
        holding.set()
    except LoadmasterError as error:
        _restore(previous)
        if interrupted:  # the interruption surfaced as a failed call (e.g. CANCELLED)
            raise typer.Exit(128 + interrupted[0]) from None
        console.print(f"[red]no lease for {mb} MB:[/red] {error}")
        raise typer.Exit(EXIT_NO_LEASE) from None
    except KeyboardInterrupt:
        _restore(previous)
        held.release()  # in case the grant arrived just before the signal
        raise typer.Exit(128 + (interrupted[0] if interrupted else signal.SIGINT)) from None
    try:  # right after the grant: whatever happens next, the lease is released
        # Ctrl-C no longer interrupts us: it goes to the command, then we release.
        if interrupted:
            raise typer.Exit(128 + interrupted[0])
        console.print(
            f"lease {held.lease_id} (token {held.fencing_token}): "
            f"{', '.join(f'GPU {i}: {m} MB' for i, m in sorted(held.mb_per_gpu.items()))} on {held.node}; "
            f"CUDA_VISIBLE_DEVICES={held.cuda_visible_devices}"
        )
        env = dict(os.environ)  # the command's environment: ours plus the lease
        env.update(
            CUDA_VISIBLE_DEVICES=held.cuda_visible_devices,
            CUDA_DEVICE_ORDER="PCI_BUS_ID",
            LOADMASTER_GPU_LEASE_ID=held.lease_id,
            LOADMASTER_GPU_FENCING_TOKEN=str(held.fencing_token),
        )
        try:
            process = subprocess.Popen(die_with_parent(command), env=env, start_new_session=True)
        except OSError as error:
            console.print(f"[red]cannot start {command[0]!r}:[/red] {error}")
            raise typer.Exit(_EXIT_NOT_STARTED) from None
        if interrupted:  # a signal arrived while the command was being started
            _signal_group(process, interrupted[0])
        if lost.is_set():  # lost before the command existed
            _stop(process)
        returncode = process.wait()
    finally:
        _restore(previous)
        held.release()
    if lost.is_set():
        raise typer.Exit(EXIT_LEASE_LOST)
    raise typer.Exit(_exit_code(returncode))


def _restore(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the command's process group now, SIGKILL it if still there after a grace period."""
    _signal_group(process, signal.SIGTERM)
    killer = threading.Timer(_KILL_GRACE_S, _signal_group, args=(process, signal.SIGKILL))
    killer.daemon = True
    killer.start()
