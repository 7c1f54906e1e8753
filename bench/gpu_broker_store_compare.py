"""Over gRPC: does the broker's hand-made Redis pipeline (`_coalesce.py`) pay for itself?

    python bench/gpu_broker_store_compare.py                      # 8 clients x 1, 6 windows each
    python bench/gpu_broker_store_compare.py --clients 4 --concurrency 8 --windows 4 --seconds 5

Two gpu-broker processes run side by side on one embedded Redis (each under its own key
prefix): the broker as shipped, whose lease store batches script ops through `_coalesce.py`
(pipelined EVALSHAs packed and parsed by hiredis, events read in bulk), and the same broker
with a store that calls the same `OPS_SCRIPT` through redis-py's own `Script` object (one
EVALSHA per op, one pooled connection per call in flight) and reads events through
redis-py's `PubSub` (both defined in `_BROKER` below). `--clients` client processes, each with `--concurrency`
asyncio loops of Acquire + Release RPCs (100 MB, best fit), drive one broker per window;
the windows alternate between the two (A B A B ...), so load from other work on the machine
falls on both alike. Per store: pairs/s per window and overall, grant latency, and the
broker's CPU per pair. Writes bench/results/gpu_broker_store_compare_<clients>x<concurrency>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
from _harness import percentiles_ms, write_result

from loadmaster.cli.redis_server import EmbeddedRedis
from loadmaster.common.grpc_client import wait_for_health_sync
from loadmaster.common.ports import free_port

STORES = ("coalescer", "redis-py")

# A broker whose lease store is the one under test: "coalescer" is the broker as shipped;
# "redis-py" swaps in a subclass that makes each script call through redis-py's `Script`
# (EVALSHA of the same OPS_SCRIPT, NOSCRIPT handled by redis-py) and reads the events channel
# through redis-py's `PubSub`.
_BROKER = r"""
import asyncio, sys
from loadmaster.common.errors import UnavailableError
from loadmaster.gpu_broker import scripts, server, store

class PubSubEvents:
    def __init__(self, pubsub):
        self._pubsub, self._pinged = pubsub, False

    @classmethod
    async def open(cls, client, channel, timeout_s):
        events = cls(client.pubsub())
        try:
            async with asyncio.timeout(timeout_s):
                await events._pubsub.subscribe(channel)
                while (m := await events._pubsub.get_message(timeout=timeout_s)) is None or m["type"] != "subscribe":
                    pass
        except (*store._REDIS_DOWN, TimeoutError) as error:
            await events.close()
            raise UnavailableError(f"no subscription: {error}") from error
        return events

    async def next_message(self, timeout_s):
        try:
            message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout_s)
            if message is None:
                if self._pinged:
                    raise UnavailableError("lost the Redis event stream: no answer to a PING")
                self._pinged = True
                await self._pubsub.ping()
                return None
        except store._REDIS_DOWN as error:
            raise UnavailableError(f"lost the Redis event stream: {error}") from error
        self._pinged = False
        return message["data"] if message["type"] == "message" else None

    async def close(self):
        await self._pubsub.aclose()

class RedisPyStore(store.RedisLeaseStore):
    def __init__(self, client, **kwargs):
        super().__init__(client, **kwargs)
        self._script = client.register_script(scripts.OPS_SCRIPT)

    async def _call(self, op, now_ms, *args):
        argv = [self._prefix, now_ms, self.channel, op.name, now_ms, len(args), *args]
        try:
            async with asyncio.timeout(self._timeout_s):
                (reply,) = await self._script(keys=self._keys, args=argv)
        except (*store._REDIS_DOWN, TimeoutError) as error:
            await self._drop_idle_connections()
            raise UnavailableError(f"Redis unreachable: {error or 'no reply in time'}") from error
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def subscribe(self, *, timeout_s=1.0):
        return await PubSubEvents.open(self._redis, self.channel, timeout_s)

if sys.argv[1] == "redis-py":
    server.RedisLeaseStore = RedisPyStore
from loadmaster.common.service import run_service
from loadmaster.gpu_broker.__main__ import _main
run_service("gpu-broker", _main, argv=[])
"""

_CLIENT = r"""
import asyncio, json, sys, time, uuid
import grpc
from loadmaster.v1 import gpu_broker_pb2 as pb, gpu_broker_pb2_grpc
address, start, seconds, concurrency = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
async def main():
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel)
        await stub.Inventory(pb.InventoryRequest(), timeout=10)  # connected before the clock starts
        latencies, pairs = [], [0]
        await asyncio.sleep(max(0.0, start - time.time()))
        end = start + seconds
        async def loop():
            holder = uuid.uuid4().hex[:8]
            while time.time() < end:
                t0 = time.perf_counter()
                lease = (await stub.Acquire(pb.AcquireRequest(
                    client_request_id=uuid.uuid4().hex, holder=holder, mb=100), timeout=10)).lease
                latencies.append(time.perf_counter() - t0)
                await stub.Release(pb.ReleaseRequest(
                    lease_id=lease.lease_id, fencing_token=lease.fencing_token), timeout=10)
                pairs[0] += 1
        cpu = time.process_time()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        print(json.dumps({"pairs": pairs[0], "cpu_s": time.process_time() - cpu, "latencies": latencies}))
asyncio.run(main())
"""


@contextlib.contextmanager
def _broker(redis_url: str, store: str, logs: Path) -> Iterator[tuple[str, psutil.Process]]:
    port = free_port()
    declared = {"bench": [{"index": n, "total_mb": 80_000} for n in range(8)]}
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "LOADMASTER_GPU_BROKER__LISTEN": f"127.0.0.1:{port}",
        "LOADMASTER_GPU_BROKER__KEY_PREFIX": f"bench-{uuid.uuid4().hex[:8]}",
        "LOADMASTER_GPU_BROKER__USE_NVML": "false",
        "LOADMASTER_GPU_BROKER__RESERVE_MB": "0",
        "LOADMASTER_GPU_BROKER__DECLARED": json.dumps(declared),
        "LOADMASTER_METRICS__ENABLED": "false",
        "LOADMASTER_LOG_LEVEL": "WARNING",
    }
    process = subprocess.Popen(
        [sys.executable, "-c", _BROKER, store],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=(logs / f"broker-{store}.log").open("wb"),
        start_new_session=True,
    )
    try:
        wait_for_health_sync(f"127.0.0.1:{port}", timeout_s=30)
        yield f"127.0.0.1:{port}", psutil.Process(process.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(10)


def _window(
    address: str, broker: psutil.Process, *, clients: int, concurrency: int, seconds: float
) -> dict[str, Any]:
    start = time.time() + 4.0
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CLIENT, address, str(start), str(seconds), str(concurrency)],
            stdout=subprocess.PIPE,
        )
        for _ in range(clients)
    ]
    time.sleep(max(0.0, start - time.time()))
    cpu = -sum(broker.cpu_times()[:2])
    outputs = [json.loads(p.communicate(timeout=seconds + 60)[0]) for p in procs]
    cpu += sum(broker.cpu_times()[:2])
    pairs = sum(o["pairs"] for o in outputs)
    return {
        "pairs": pairs,
        "pairs_per_s": round(pairs / seconds, 1),
        "broker_cpu_us_per_pair": round(cpu / max(pairs, 1) * 1e6, 1),
        "latencies": [x for o in outputs for x in o["latencies"]],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8, help="client processes")
    parser.add_argument("--concurrency", type=int, default=1, help="Acquire+Release loops per client process")
    parser.add_argument("--windows", type=int, default=6, help="measured windows per store")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of one window")
    args = parser.parse_args()
    windows: dict[str, list[dict[str, Any]]] = {store: [] for store in STORES}
    with (
        EmbeddedRedis() as redis_server,
        tempfile.TemporaryDirectory(prefix="gpu-bench-") as logs,
        _broker(redis_server.url, STORES[0], Path(logs)) as first,
        _broker(redis_server.url, STORES[1], Path(logs)) as second,
    ):
        brokers = dict(zip(STORES, (first, second), strict=True))
        for n in range(2 * args.windows):
            store = STORES[n % 2]
            result = _window(
                *brokers[store], clients=args.clients, concurrency=args.concurrency, seconds=args.seconds
            )
            windows[store].append(result)
            print(
                f"window {n + 1}/{2 * args.windows} {store}: {result['pairs_per_s']} pairs/s, "
                f"broker {result['broker_cpu_us_per_pair']} us CPU/pair",
                flush=True,
            )
    results: dict[str, Any] = {
        "clients": args.clients,
        "concurrency": args.concurrency,
        "seconds_per_window": args.seconds,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    for store, runs in windows.items():
        rates = [run["pairs_per_s"] for run in runs]
        results[store] = {
            "pairs_per_s": round(sum(run["pairs"] for run in runs) / (args.seconds * len(runs)), 1),
            "pairs_per_s_by_window": rates,
            "pairs_per_s_median": statistics.median(rates),
            "broker_cpu_us_per_pair": round(statistics.median(r["broker_cpu_us_per_pair"] for r in runs), 1),
            "grant_latency": percentiles_ms([x for run in runs for x in run["latencies"]]),
        }
    coalescer, plain = results["coalescer"]["pairs_per_s"], results["redis-py"]["pairs_per_s"]
    results["coalescer_gain"] = round(coalescer / plain - 1, 3)
    print(json.dumps({k: v for k, v in results.items()}, indent=1))
    name = f"gpu_broker_store_compare_{args.clients}x{args.concurrency}"
    print(f"wrote {write_result(name, results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
