"""How long one 64 MiB gRPC message holds an event loop, for each way of placing a grpcio server
(issue 35 item 4: the measurement that chose the gateway's gRPC relay process).

    python bench/grpc_server_arrangements.py              # 3 runs of each arrangement, ~1 minute
    python bench/grpc_server_arrangements.py --runs 5 --messages 6

A loop stands for the gateway's: a task sleeps 1 ms again and again and records how late each
wake-up is. A client process sends `--messages` 64 MiB messages (half a second apart) to a
ModelInfer handler that takes raw bytes (no protobuf parse at all: what is left is grpcio's own
receive path), served in one of these arrangements:

  loop        grpc.aio server on the measured loop (the gateway before issue 35)
  thread-aio  grpc.aio server on a thread of its own, with its own event loop
  sync        grpcio's synchronous server, handlers on its thread pool
  process     the gateway's relay (`loadmaster.gateway.frontends.grpc_relay`) in a process of
              its own, relaying to a grpc.aio server on the measured loop over a unix socket,
              the message handed over through shared memory (`grpc_handoff`)

Prints the longest lag per run and writes bench/results/grpc_server_arrangements.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc
from _harness import write_result

SIZE = 64 << 20
OPTIONS = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]
SERVICE = "inference.GRPCInferenceService"
METHOD = f"/{SERVICE}/ModelInfer"
ARRANGEMENTS = ("loop", "thread-aio", "sync", "process")


def client(address: str, messages: int) -> None:
    with grpc.insecure_channel(address, options=OPTIONS) as channel:
        call = channel.unary_unary(METHOD)
        data = b"\x01" * SIZE
        for _ in range(messages):
            call(data, timeout=60)
            time.sleep(0.5)


def _aio_handler() -> grpc.GenericRpcHandler:
    from loadmaster.gateway.frontends import grpc_handoff

    async def infer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if grpc_handoff.is_marker(request):  # behind the relay: mapped, not copied
            return str(len(grpc_handoff.take(request))).encode()
        return str(len(request)).encode()

    return grpc.method_handlers_generic_handler(
        SERVICE, {"ModelInfer": grpc.unary_unary_rpc_method_handler(infer)}
    )


def _sync_handler() -> grpc.GenericRpcHandler:
    def infer(request: bytes, context: grpc.ServicerContext) -> bytes:
        return str(len(request)).encode()

    return grpc.method_handlers_generic_handler(
        SERVICE, {"ModelInfer": grpc.unary_unary_rpc_method_handler(infer)}
    )


async def _lags(stop: asyncio.Event, into: list[float]) -> None:
    while not stop.is_set():
        asked = time.perf_counter()
        await asyncio.sleep(0.001)
        into.append(time.perf_counter() - asked - 0.001)


async def measure(arrangement: str, messages: int) -> float:
    """The longest lag of this loop while `messages` 64 MiB messages arrive, in ms."""
    from loadmaster.common.ports import free_port
    from loadmaster.gateway.frontends.grpc_relay import RelayConfig

    cleanup: list[Any] = []
    address = f"127.0.0.1:{free_port()}"
    if arrangement in ("loop", "process"):
        server = grpc.aio.server(options=OPTIONS)
        server.add_generic_rpc_handlers((_aio_handler(),))
        if arrangement == "loop":
            server.add_insecure_port(address)
        else:
            folder = tempfile.TemporaryDirectory(prefix="loadmaster-bench-")
            upstream = f"unix:{Path(folder.name) / 'up.sock'}"
            server.add_insecure_port(upstream)
            config = RelayConfig(
                listen=address,
                upstream=upstream,
                methods={METHOD: "unary_unary"},
                handoff_methods=[METHOD],
                large_message_bytes=1 << 20,
                options=OPTIONS,
                grace_s=1.0,
            )
            relay = subprocess.Popen(
                [sys.executable, "-m", "loadmaster.gateway.frontends.grpc_relay"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            assert relay.stdin is not None and relay.stdout is not None
            relay.stdin.write(json.dumps(asdict(config)).encode() + b"\n")
            relay.stdin.flush()
            await asyncio.to_thread(relay.stdout.readline)  # {"port": N}: it serves
            cleanup += [relay, folder]
        await server.start()
        cleanup.append(server)
    elif arrangement == "thread-aio":
        ready = threading.Event()
        holder: dict[str, Any] = {}

        def run() -> None:
            async def main() -> None:
                server = grpc.aio.server(options=OPTIONS)
                server.add_generic_rpc_handlers((_aio_handler(),))
                server.add_insecure_port(address)
                await server.start()
                holder["loop"], holder["stop"] = asyncio.get_running_loop(), asyncio.Event()
                ready.set()
                await holder["stop"].wait()
                await server.stop(0)

            asyncio.run(main())

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        ready.wait(10)
        cleanup.append(lambda: holder["loop"].call_soon_threadsafe(holder["stop"].set))
    else:
        sync_server = grpc.server(futures.ThreadPoolExecutor(4), options=OPTIONS)
        sync_server.add_generic_rpc_handlers((_sync_handler(),))
        sync_server.add_insecure_port(address)
        sync_server.start()
        cleanup.append(lambda: sync_server.stop(0))
    stop, lags = asyncio.Event(), []
    watcher = asyncio.create_task(_lags(stop, lags))
    sender = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--client", address, str(messages)
    )
    await sender.wait()
    stop.set()
    await watcher
    for item in reversed(cleanup):
        if isinstance(item, grpc.aio.Server):
            await item.stop(0)
        elif isinstance(item, subprocess.Popen):
            item.stdin.close()
            item.wait(10)
        elif isinstance(item, tempfile.TemporaryDirectory):
            item.cleanup()
        else:
            item()
    return round(max(lags) * 1000, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--client", nargs=2, metavar=("ADDRESS", "MESSAGES"), help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--messages", type=int, default=4, help="64 MiB messages per run")
    args = parser.parse_args()
    if args.client:
        client(args.client[0], int(args.client[1]))
        return 0
    results: dict[str, list[float]] = {arrangement: [] for arrangement in ARRANGEMENTS}
    for run in range(args.runs):  # arrangements interleaved, so a busy spell hits all of them
        for arrangement in ARRANGEMENTS:
            lag = asyncio.run(measure(arrangement, args.messages))
            results[arrangement].append(lag)
            print(f"run {run + 1}: {arrangement:<10} longest loop lag {lag:7.1f} ms", flush=True)
    path = write_result(
        "grpc_server_arrangements",
        {
            "message_bytes": SIZE,
            "messages_per_run": args.messages,
            "handler": "raw bytes (no protobuf parse)",
            "longest_loop_lag_ms": results,
        },
    )
    for arrangement, lags in results.items():
        print(f"{arrangement:<10} longest loop lag per run (ms): {lags}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
