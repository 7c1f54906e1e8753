"""Acquire + Release pairs per second with 8 concurrent clients on one Redis; grant latency.

    python bench/gpu_broker_throughput.py                       # both modes, 8 clients, 5 s each
    python bench/gpu_broker_throughput.py --mode grpc --replicas 1 2 --seconds 10
    python bench/gpu_broker_throughput.py --mode core --processes 2   # two replicas, 4 clients each
    python bench/gpu_broker_throughput.py --redis-url redis://127.0.0.1:6379/0

Modes:
- `core`: 8 asyncio clients call `LeaseManager` in one process on uvloop, as the service runs
  (the broker's own logic and its Lua scripts on a real Redis, no gRPC): what one Redis
  sustains.
- `grpc`: 8 client processes against `--replicas` gpu-broker processes (the whole path as a
  model-pool worker sees it), each client a blocking loop of `Acquire` + `Release` RPCs.
  Several `--replicas` values run one after the other (`grpc`, then `grpc_x2`, ...). The
  clients are also run once against an echo server (the same proto and client processes, a
  grpc.aio server on uvloop that answers every op at once, no broker and no Redis): its rate
  (`transport_floor`) is what gRPC in Python sustains on this machine with nothing behind
  it, and `share_of_floor` says how close the broker comes to it.

Each pair acquires 100 MB (best fit, any GPU) and releases it at once. Grant latency is the
Acquire call as the client sees it. `cpu_us_per_pair` says where the CPU went during the
measured window (clients, broker processes, Redis from its INFO): on a small machine every
part shares the same cores, so that, not Redis, bounds the rate. `load_avg_1m` is the
machine's load just before the run (other work makes the numbers move). Writes
bench/results/gpu_broker_throughput.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import redis
from _harness import percentiles_ms, write_result

from loadmaster.cli.redis_server import EmbeddedRedis
from loadmaster.common.clock import SystemClock
from loadmaster.common.grpc_client import wait_for_health_sync
from loadmaster.common.ports import free_port
from loadmaster.gpu_broker.leases import AcquireRequest, GpuState, PlacementRequest
from loadmaster.gpu_broker.manager import LeaseManager
from loadmaster.gpu_broker.store import RedisLeaseStore

TARGET_PAIRS_PER_S = 5_000
GPUS = [GpuState("bench", index, total_mb=80_000, reserve_mb=0) for index in range(8)]


def _redis_cpu_s(admin: redis.Redis) -> float:
    info = admin.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _per_pair_us(pairs: int, **cpu_s: float) -> dict[str, float]:
    return {role: round(seconds / max(pairs, 1) * 1e6, 1) for role, seconds in cpu_s.items()}


async def _core_loop(redis_url: str, prefix: str, clients: int, seconds: float) -> dict[str, Any]:
    store = RedisLeaseStore.connect(redis_url, key_prefix=prefix)
    manager = LeaseManager(store, clock=SystemClock(), default_ttl_s=30, default_reserve_mb=0)
    await manager.register_node("bench", GPUS)
    latencies: list[float] = []
    pairs = 0
    deadline = time.perf_counter() + seconds

    async def client(n: int) -> None:
        nonlocal pairs
        request = 0
        while time.perf_counter() < deadline:
            request += 1
            started = time.perf_counter()
            lease = await manager.acquire(
                AcquireRequest(
                    f"{prefix}-{os.getpid()}-{n}-{request}", f"bench-{n}", PlacementRequest(mb=100)
                )
            )
            latencies.append(time.perf_counter() - started)
            await manager.release(lease.lease_id, fencing_token=lease.fencing_token)
            pairs += 1

    started, cpu_started = time.perf_counter(), time.process_time()
    await asyncio.gather(*(client(n) for n in range(clients)))
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    await store.close()
    return {"pairs": pairs, "seconds": elapsed, "cpu_s": cpu, "latencies": latencies}


def _core_process(redis_url: str, prefix: str, clients: int, seconds: float) -> dict[str, Any]:
    import uvloop

    return uvloop.run(_core_loop(redis_url, prefix, clients, seconds))


def _core(redis_url: str, *, clients: int, seconds: float, processes: int) -> dict[str, Any]:
    """`clients` asyncio clients spread over `processes` processes, each its own LeaseManager
    (a broker replica without gRPC), on the one Redis."""
    import multiprocessing

    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    admin = redis.Redis.from_url(redis_url)
    admin.config_resetstat()
    redis_cpu = _redis_cpu_s(admin)
    shares = [clients // processes + (1 if n < clients % processes else 0) for n in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        outputs = pool.starmap(_core_process, [(redis_url, prefix, share, seconds) for share in shares])
    redis_cpu = _redis_cpu_s(admin) - redis_cpu  # includes the processes' set-up: a few ms
    evalsha = admin.info("commandstats").get("cmdstat_evalsha", {})
    admin.close()
    pairs = sum(o["pairs"] for o in outputs)
    elapsed = max(o["seconds"] for o in outputs)
    return {
        "processes": processes,
        "pairs": pairs,
        "seconds": round(elapsed, 3),
        "pairs_per_s": round(pairs / elapsed, 1),
        "grant_latency": percentiles_ms([x for o in outputs for x in o["latencies"]]),
        # Time Redis itself spends per script call; the rest of a pair's cost is the client side.
        "redis_script_calls": evalsha.get("calls", 0),
        "redis_us_per_script_call": evalsha.get("usec_per_call", 0.0),
        "cpu_us_per_pair": _per_pair_us(pairs, clients=sum(o["cpu_s"] for o in outputs), redis=redis_cpu),
    }


_GRPC_CLIENT = r"""
import json, sys, time, uuid
import grpc
from loadmaster.v1 import gpu_broker_pb2 as pb, gpu_broker_pb2_grpc
address, start, seconds = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
stub = gpu_broker_pb2_grpc.GpuBrokerServiceStub(grpc.insecure_channel(address))
stub.Inventory(pb.InventoryRequest(), timeout=10)  # connected before the clock starts
latencies, pairs = [], 0
time.sleep(max(0.0, start - time.time()))
end = start + seconds
holder = uuid.uuid4().hex[:8]
cpu = time.process_time()
while time.time() < end:
    t0 = time.perf_counter()
    lease = stub.Acquire(pb.AcquireRequest(client_request_id=uuid.uuid4().hex, holder=holder, mb=100), timeout=10).lease
    latencies.append(time.perf_counter() - t0)
    stub.Release(pb.ReleaseRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token), timeout=10)
    pairs += 1
print(json.dumps({"pairs": pairs, "cpu_s": time.process_time() - cpu, "latencies": latencies}))
"""


# The transport floor: the broker's proto served by a grpc.aio server (uvloop, as the broker
# runs) that answers each op at once from the request alone.
_ECHO_SERVER = r"""
import asyncio, sys
import grpc, uvloop
from loadmaster.v1 import gpu_broker_pb2 as pb, gpu_broker_pb2_grpc

def lease(request, token):
    return pb.Lease(lease_id="%032x" % token, holder=request.holder, node="bench", fencing_token=token,
                    mb_per_gpu={0: request.mb}, created_unix_ms=1, expires_unix_ms=30_001)

class Echo(gpu_broker_pb2_grpc.GpuBrokerServiceServicer):
    tokens = 0
    async def Inventory(self, request, context):
        return pb.InventoryResponse()
    async def Acquire(self, request, context):
        Echo.tokens += 1
        return pb.AcquireResponse(lease=lease(request, Echo.tokens))
    async def Release(self, request, context):
        return pb.ReleaseResponse(released=True)

async def main():
    server = grpc.aio.server()
    gpu_broker_pb2_grpc.add_GpuBrokerServiceServicer_to_server(Echo(), server)
    server.add_insecure_port(sys.argv[1])
    await server.start()
    await server.wait_for_termination()

uvloop.run(main())
"""


@contextlib.contextmanager
def _brokers(redis_url: str, replicas: int, logs: Path) -> Iterator[dict[str, psutil.Process]]:
    """`replicas` gpu-broker processes on one key prefix: {address: process}."""
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    declared = {"bench": [{"index": g.index, "total_mb": g.total_mb} for g in GPUS]}
    processes: list[subprocess.Popen[bytes]] = []
    brokers: dict[str, psutil.Process] = {}
    try:
        for n in range(replicas):
            port = free_port()
            env = {
                **os.environ,
                "REDIS_URL": redis_url,
                "LOADMASTER_GPU_BROKER__LISTEN": f"127.0.0.1:{port}",
                "LOADMASTER_GPU_BROKER__KEY_PREFIX": prefix,
                "LOADMASTER_GPU_BROKER__USE_NVML": "false",
                "LOADMASTER_GPU_BROKER__RESERVE_MB": "0",
                "LOADMASTER_GPU_BROKER__DECLARED": json.dumps(declared),
                "LOADMASTER_METRICS__ENABLED": "false",
                "LOADMASTER_LOG_LEVEL": "WARNING",
            }
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "loadmaster.gpu_broker"],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=(logs / f"broker-{n}.log").open("wb"),
                    start_new_session=True,
                )
            )
            wait_for_health_sync(f"127.0.0.1:{port}", timeout_s=30)
            brokers[f"127.0.0.1:{port}"] = psutil.Process(processes[-1].pid)
        yield brokers
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            process.wait(10)


def _drive(
    addresses: list[str], servers: list[psutil.Process], *, clients: int, seconds: float
) -> tuple[list[dict[str, Any]], float]:
    """Run `clients` client processes against `addresses`: (their outputs, the CPU
    seconds `servers` used while they ran)."""
    start = time.time() + 5.0
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _GRPC_CLIENT, addresses[n % len(addresses)], str(start), str(seconds)],
            stdout=subprocess.PIPE,
        )
        for n in range(clients)
    ]
    time.sleep(max(0.0, start - time.time()))
    server_cpu = -sum(sum(s.cpu_times()[:2]) for s in servers)
    outputs = [json.loads(p.communicate(timeout=seconds + 60)[0]) for p in procs]
    server_cpu += sum(sum(s.cpu_times()[:2]) for s in servers)
    return outputs, server_cpu


def _grpc(redis_url: str, *, clients: int, seconds: float, replicas: int) -> dict[str, Any]:
    admin = redis.Redis.from_url(redis_url)
    with (
        tempfile.TemporaryDirectory(prefix="gpu-bench-") as logs,
        _brokers(redis_url, replicas, Path(logs)) as brokers,
    ):
        redis_cpu = -_redis_cpu_s(admin)
        outputs, broker_cpu = _drive(list(brokers), list(brokers.values()), clients=clients, seconds=seconds)
        redis_cpu += _redis_cpu_s(admin)
    admin.close()
    pairs = sum(o["pairs"] for o in outputs)
    latencies = [x for o in outputs for x in o["latencies"]]
    return {
        "replicas": replicas,
        "pairs": pairs,
        "seconds": seconds,
        "pairs_per_s": round(pairs / seconds, 1),
        "grant_latency": percentiles_ms(latencies),
        "cpu_us_per_pair": _per_pair_us(
            pairs, clients=sum(o["cpu_s"] for o in outputs), brokers=broker_cpu, redis=redis_cpu
        ),
    }


def wait_for_grpc(address: str, *, timeout_s: float) -> None:
    """Until a gRPC server accepts connections at `address` (the echo server has no health service)."""
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)


def _transport_floor(*, clients: int, seconds: float) -> dict[str, Any]:
    """The same client processes against the echo server: gRPC's own cost, nothing behind it."""
    address = f"127.0.0.1:{free_port()}"
    server = subprocess.Popen(
        [sys.executable, "-c", _ECHO_SERVER, address], stdout=subprocess.DEVNULL, start_new_session=True
    )
    try:
        wait_for_grpc(address, timeout_s=30)
        outputs, server_cpu = _drive(
            [address], [psutil.Process(server.pid)], clients=clients, seconds=seconds
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(10)
    pairs = sum(o["pairs"] for o in outputs)
    return {
        "pairs_per_s": round(pairs / seconds, 1),
        "cpu_us_per_pair": _per_pair_us(pairs, clients=sum(o["cpu_s"] for o in outputs), server=server_cpu),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["core", "grpc", "both"], default="both")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument(
        "--replicas",
        type=int,
        nargs="+",
        default=[1],
        help="gpu-broker processes (grpc mode; several: one run each)",
    )
    parser.add_argument("--processes", type=int, default=1, help="processes sharing the clients (core mode)")
    parser.add_argument("--redis-url", help="use this Redis (default: an embedded redis-server)")
    args = parser.parse_args()
    results: dict[str, Any] = {
        "clients": args.clients,
        "target_pairs_per_s": TARGET_PAIRS_PER_S,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    with contextlib.ExitStack() as stack:
        redis_url = args.redis_url or stack.enter_context(EmbeddedRedis()).url
        if args.mode in ("core", "both"):
            print(
                f"core: {args.clients} clients, {args.processes} process(es), {args.seconds:g} s…", flush=True
            )
            results["core"] = _core(
                redis_url, clients=args.clients, seconds=args.seconds, processes=args.processes
            )
            print(json.dumps(results["core"]), flush=True)
        if args.mode in ("grpc", "both"):
            for replicas in args.replicas:
                print(
                    f"grpc: {args.clients} client processes, {replicas} broker(s), {args.seconds:g} s…",
                    flush=True,
                )
                key = "grpc" if replicas == args.replicas[0] else f"grpc_x{replicas}"
                results[key] = _grpc(redis_url, clients=args.clients, seconds=args.seconds, replicas=replicas)
                print(json.dumps(results[key]), flush=True)
            print("grpc transport floor (echo server, no broker): …", flush=True)
            floor = _transport_floor(clients=args.clients, seconds=args.seconds)
            print(json.dumps(floor), flush=True)
            for key, result in results.items():
                if key.startswith("grpc"):
                    result["transport_floor"] = floor
                    result["share_of_floor"] = round(result["pairs_per_s"] / floor["pairs_per_s"], 3)
    results["targets"] = [
        {
            "name": f"Acquire+Release pairs/s, {args.clients} clients ({key}, {_setup(results[key])})",
            "measured": results[key]["pairs_per_s"],
            "target": TARGET_PAIRS_PER_S,
            "unit": "/s",
            "met": results[key]["pairs_per_s"] >= TARGET_PAIRS_PER_S,
        }
        for key in results
        if key.startswith(("grpc", "core"))
    ]
    path = write_result("gpu_broker_throughput", results)
    print(f"wrote {path}")
    return 0


def _setup(result: dict[str, Any]) -> str:
    if "replicas" in result:
        return f"{result['replicas']} broker process(es)"
    return f"{result['processes']} process(es)"


if __name__ == "__main__":
    sys.exit(main())
