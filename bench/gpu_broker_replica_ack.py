"""What waiting for a Redis replica (`gpu_broker.replica_ack_timeout_ms`, `WAIT 1`) costs an Acquire.

    python bench/gpu_broker_replica_ack.py                  # 3 windows per mode, 1 and 8 clients
    python bench/gpu_broker_replica_ack.py --windows 2 --pairs 500

A master and one replica (two embedded redis-servers on loopback, the replica attached with
REPLICAOF) and two gpu-brokers in this process, each under its own key prefix: one with the
wait off (0), one with it on (200 ms). Windows alternate between them (A B A B ...), so load
from other work on the machine falls on both alike. In each window: `--pairs` Acquire +
Release pairs from one client, one after the other (Acquire latency over gRPC), then 8
clients back to back for the same number of pairs each (pairs/s). Writes
bench/results/gpu_broker_replica_ack.json.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from typing import Any

import grpc
import redis
from _harness import percentiles_ms, write_result

from loadmaster.cli.redis_server import EmbeddedRedis
from loadmaster.common.config import GpuBrokerSettings, GpuSpec, MetricsSettings, Settings
from loadmaster.gpu_broker.server import build
from loadmaster.v1 import gpu_broker_pb2 as pb
from loadmaster.v1 import gpu_broker_pb2_grpc

MODES = {"wait off": 0, "wait on (WAIT 1 200)": 200}


def _attach(replica: EmbeddedRedis, master: EmbeddedRedis) -> None:
    redis.Redis(port=master.port, password=master.password).config_set("repl-diskless-sync-delay", 0)
    admin = redis.Redis(port=replica.port, password=replica.password)
    admin.config_set("masterauth", master.password)
    admin.replicaof("127.0.0.1", master.port)
    deadline = time.monotonic() + 15
    check = redis.Redis(port=master.port, password=master.password, decode_responses=True)
    while check.info("replication").get("slave0", {}).get("state") != "online":
        if time.monotonic() > deadline:
            sys.exit("the replica did not come online")
        time.sleep(0.05)


async def _pairs(stub: Any, count: int, latencies: list[float] | None) -> None:
    for _ in range(count):
        started = time.perf_counter()
        lease = (await stub.Acquire(pb.AcquireRequest(holder="bench", mb=100))).lease
        if latencies is not None:
            latencies.append(time.perf_counter() - started)
        await stub.Release(pb.ReleaseRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token))


async def main(args: argparse.Namespace) -> None:
    master, replica = EmbeddedRedis(appendonly=False).start(), EmbeddedRedis(appendonly=False).start()
    servers, channels = [], []
    try:
        _attach(replica, master)
        stubs = {}
        for mode, ack_ms in MODES.items():
            settings = Settings(
                redis_url=master.url,
                gpu_broker=GpuBrokerSettings(
                    listen="127.0.0.1:0",
                    key_prefix=f"bench-{uuid.uuid4().hex[:8]}",
                    use_nvml=False,
                    reserve_mb=0,
                    declared={"n1": [GpuSpec(index=0, total_mb=100_000)]},
                    replica_ack_timeout_ms=ack_ms,
                ),
                metrics=MetricsSettings(enabled=False),
            )
            server = await build(settings)
            port = await server.start()
            servers.append(server)
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            channels.append(channel)
            stubs[mode] = gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel)
            await _pairs(stubs[mode], 50, None)  # warm up: connections, script load
        latencies: dict[str, list[float]] = {mode: [] for mode in MODES}
        rates: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(args.windows):
            for mode, stub in stubs.items():
                await _pairs(stub, args.pairs, latencies[mode])
                started = time.perf_counter()
                await asyncio.gather(*(_pairs(stub, args.pairs, None) for _ in range(8)))
                rates[mode].append(8 * args.pairs / (time.perf_counter() - started))
        result: dict[str, Any] = {"pairs_per_window": args.pairs, "windows": args.windows, "modes": {}}
        for mode in MODES:
            summary = percentiles_ms(latencies[mode])
            result["modes"][mode] = {
                "acquire_latency_1_client": summary,
                "pairs_per_s_8_clients": [round(rate) for rate in rates[mode]],
            }
            print(
                f"{mode:>22}: Acquire p50 {summary['p50_ms']:.3f} ms, p99 {summary['p99_ms']:.3f} ms "
                f"(1 client); 8 clients: {', '.join(str(round(r)) for r in rates[mode])} pairs/s"
            )
        print(f"wrote {write_result('gpu_broker_replica_ack', result)}")
    finally:
        for channel in channels:
            await channel.close()
        for server in servers:
            await server.stop()
        replica.stop()
        master.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=1000)
    asyncio.run(main(parser.parse_args()))
