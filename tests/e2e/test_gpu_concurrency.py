"""50 processes acquire and release leases for 10 s through two broker replicas; an audit of
every change, replayed in the order Redis applied it, shows no GPU was ever overcommitted.

The audit listens to the broker's event channel directly: every script publishes its change
from inside the script, so the channel is the exact serial history of the books.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from loadmaster.common.grpc_client import wait_for_health_sync
from loadmaster.common.ports import free_port
from loadmaster.v1 import gpu_broker_pb2 as pb
from loadmaster.v1 import gpu_broker_pb2_grpc

pytestmark = pytest.mark.slow

PROCESSES = 50
DURATION_S = 10.0
CAPACITY = {("n1", 0): 4_000, ("n1", 1): 3_000, ("n2", 0): 2_000}
CONFIG = """
gpu_broker:
  address: 127.0.0.1:{port}
  listen: 127.0.0.1:{port}
  key_prefix: {prefix}
  use_nvml: false
  reserve_mb: 0
  declared:
    n1: [{{index: 0, total_mb: 4000}}, {{index: 1, total_mb: 3000}}]
    n2: [{{index: 0, total_mb: 2000}}]
metrics:
  enabled: false
"""

WORKER = r"""
import json, random, sys, time, uuid
import grpc
from loadmaster.v1 import gpu_broker_pb2 as pb, gpu_broker_pb2_grpc

address, start, duration, out = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
rng = random.Random(out)
stub = gpu_broker_pb2_grpc.GpuBrokerServiceStub(grpc.insecure_channel(address))
grants, refused = [], 0
time.sleep(max(0.0, start - time.time()))
while time.time() < start + duration:
    node = rng.choice(["", "n1", "n2"])
    request = pb.AcquireRequest(client_request_id=uuid.uuid4().hex, holder=out[-12:], node=node,
                                mb=rng.randint(100, 1500), allow_split=rng.random() < 0.3, ttl_s=1.0)
    try:
        lease = stub.Acquire(request, timeout=10).lease
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
        refused += 1
        time.sleep(rng.uniform(0, 0.01))
        continue
    grants.append(lease.lease_id)
    time.sleep(rng.uniform(0, 0.03))
    if rng.random() < 0.9:  # else the holder "crashes": the lease expires
        stub.Release(pb.ReleaseRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token), timeout=10)
json.dump({"grants": grants, "refused": refused}, open(out, "w"))
"""


def _start_broker(config: Path, redis_url: str, port: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [sys.executable, "-m", "loadmaster.gpu_broker", "--config", str(config)],
        env={**os.environ, "REDIS_URL": redis_url, "LOADMASTER_GPU_BROKER__LISTEN": f"127.0.0.1:{port}"},
        stdout=subprocess.DEVNULL,
        stderr=(config.parent / f"broker-{port}.log").open("wb"),
        start_new_session=True,
    )
    wait_for_health_sync(f"127.0.0.1:{port}", timeout_s=30)
    return process


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture
def replicas(redis_url: str, tmp_path: Path) -> Iterator[tuple[list[str], str]]:
    ports = [free_port(), free_port()]
    prefix = f"conc-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "loadmaster.yaml"
    config.write_text(CONFIG.format(port=ports[0], prefix=prefix))
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for port in ports:
            processes.append(_start_broker(config, redis_url, port))
        yield [f"127.0.0.1:{port}" for port in ports], prefix
    finally:
        for process in processes:
            _stop(process)


def test_fifty_processes_never_overcommit(
    redis_url: str, replicas: tuple[list[str], str], tmp_path: Path
) -> None:
    addresses, prefix = replicas
    history: list[dict[str, object]] = []
    listener = redis.Redis.from_url(redis_url, decode_responses=True).pubsub()
    listener.subscribe(f"{prefix}:events")
    assert listener.get_message(timeout=5)["type"] == "subscribe"  # type: ignore[index]
    stop = threading.Event()

    def listen() -> None:
        while not stop.is_set():
            message = listener.get_message(timeout=0.5)
            if message and message["type"] == "message":
                history.append(json.loads(message["data"]))

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    start = time.time() + 8.0  # every worker has imported grpc by then
    outputs = [tmp_path / f"worker-{n}.json" for n in range(PROCESSES)]
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, addresses[n % 2], str(start), str(DURATION_S), str(out)],
            start_new_session=True,
        )
        for n, out in enumerate(outputs)
    ]
    try:
        for worker in workers:
            assert worker.wait(DURATION_S + 60) == 0
    finally:
        for worker in workers:
            if worker.poll() is None:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
    time.sleep(2.0)  # abandoned leases (TTL 1 s) expire; the reaper runs every ~1 s
    with grpc.insecure_channel(addresses[0]) as channel:
        gpus = (
            gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel).Inventory(pb.InventoryRequest(), timeout=5).gpus
        )
    time.sleep(0.5)
    stop.set()
    thread.join(5)
    listener.close()

    results = [json.loads(out.read_text()) for out in outputs]
    granted = {lease_id for r in results for lease_id in r["grants"]}
    assert len(granted) > 500, f"too little traffic to mean anything: {len(granted)} grants"
    assert sum(r["refused"] for r in results) > 0, "no contention: the audit would prove nothing"

    acquired = [e for e in history if e["kind"] == "acquired"]
    assert {e["lease"]["id"] for e in acquired} == granted  # the audit saw every grant, and only those
    booked: dict[tuple[str, int], int] = defaultdict(int)
    peak: dict[tuple[str, int], int] = defaultdict(int)
    for event in history:
        lease = event["lease"]
        sign = {"acquired": 1, "released": -1, "expired": -1}.get(str(event["kind"]), 0)
        for part in str(lease["alloc"]).split(","):
            index, mb = part.split("=")
            key = (str(lease["node"]), int(index))
            booked[key] += sign * int(mb)
            assert booked[key] <= CAPACITY[key], f"overcommit on {key}: {booked[key]} MB booked"
            peak[key] = max(peak[key], booked[key])
    assert all(mb == 0 for mb in booked.values()), booked  # every grant was released or reaped
    assert all(g.leased_mb == 0 for g in gpus)
    assert any(peak[key] > CAPACITY[key] // 2 for key in CAPACITY)  # the cards were really contended
    print(f"grants={len(granted)} refused={sum(r['refused'] for r in results)} peak={dict(peak)}")
