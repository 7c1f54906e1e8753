"""Leases that hold under load (issue 25, Found 2): a 60 MB BYTES observation sent to a worker
that holds 3 s leases. Decoding it takes seconds (2-7 s here, with the machine's load; on old
main it ran on the worker's event loop, where the renewals ran too). The worker's leases must
be renewed all along, its models stay loaded, and no moment promises the memory twice.

The observation goes to `policy`, which declares a float32 `state`: it is decoded, then
refused naming the tensor, so the seconds spent are the decode's (an engine that held the GIL
for seconds would stall every thread of the worker, the lease keeper's included: see
docs/leases.md).

The broker runs on a thread of its own (its own event loop), and a competing holder plus an
auditor run on another, so neither waits for the worker's event loop: if that loop stalls, the
broker keeps time and the competitor would be granted whatever the worker's leases lose.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from loadmaster.model_pool.pool import ModelPool
from loadmaster.model_pool.slots import ModelState
from loadmaster.v1 import errors_pb2, gpu_broker_pb2, gpu_broker_pb2_grpc, model_pool_pb2, tensor_pb2

pytestmark = pytest.mark.slow  # the 60 MB decode alone takes 2-7 s here

TOTAL_MB = 1_000
WORKER = "worker-test"


@dataclass
class Audit:
    """What the auditor saw, sample by sample."""

    samples: int = 0
    competitor_grants: list[int] = field(default_factory=list)
    double_promises: list[str] = field(default_factory=list)
    missing_worker_leases: list[str] = field(default_factory=list)
    broker_errors: list[str] = field(default_factory=list)


def audit(address: str, pool: ModelPool, worker_leases: set[str], stop: threading.Event, out: Audit) -> None:
    """On its own thread until `stop`: a competitor asks for the whole GPU (it fits only if the
    worker's leases lapsed at the broker), and each sample checks that memory the broker
    promises to others plus memory the worker still holds never exceeds the GPU."""
    with grpc.insecure_channel(address) as channel:
        stub = gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel)
        while not stop.is_set():
            try:
                granted = stub.Acquire(
                    gpu_broker_pb2.AcquireRequest(holder="competitor", mb=TOTAL_MB, ttl_s=60), timeout=5
                ).lease
                out.competitor_grants.append(sum(granted.mb_per_gpu.values()))
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    out.broker_errors.append(str(error.code()))
            try:
                leases = stub.ListLeases(gpu_broker_pb2.ListLeasesRequest(), timeout=5).leases
            except grpc.RpcError as error:
                out.broker_errors.append(str(error.code()))
                continue
            others_mb = sum(sum(x.mb_per_gpu.values()) for x in leases if x.holder != WORKER)
            held_mb = sum(s.vram_mb for s in pool.statuses() if s.state is not ModelState.IDLE)
            if others_mb + held_mb > TOTAL_MB:
                out.double_promises.append(f"others {others_mb} MB + worker {held_mb} MB > {TOTAL_MB}")
            live = {x.lease_id for x in leases if x.holder == WORKER}
            if not worker_leases <= live:
                out.missing_worker_leases.append(f"{sorted(worker_leases - live)} at sample {out.samples}")
            out.samples += 1
            stop.wait(0.05)


def bytes_observation(size: int) -> tuple[model_pool_pb2.InferRequest, bytes]:
    """One BYTES tensor of `size` bytes, as costly to check as BYTES gets: empty elements,
    each only its 4-byte length prefix (15 M elements in 60 MB: 2-6 s to decode here)."""
    count = size // 4
    payload = np.zeros(count, np.uint32).tobytes()
    tensor = tensor_pb2.Tensor(
        key="state", dtype=tensor_pb2.DTYPE_BYTES, shape=[count], byte_offset=0, byte_length=len(payload)
    )
    return model_pool_pb2.InferRequest(request_id="huge", model_id="policy", inputs=[tensor]), payload


async def test_a_60_mb_bytes_request_keeps_the_leases_and_the_models(
    broker_thread: Any, example_repo: Path, start_worker: Any, make_client: Any
) -> None:
    with broker_thread(total_mb=TOTAL_MB) as address:
        async with start_worker(
            example_repo, preload=["double", "policy"], broker_address=address, lease_ttl_s=3.0
        ) as worker:
            before = {s.model_id: s.lease_id for s in worker.pool.statuses() if s.state is ModelState.READY}
            assert sorted(before) == ["double", "policy"]
            stop, seen = threading.Event(), Audit()
            auditor = threading.Thread(
                target=audit, args=(address, worker.pool, set(before.values()), stop, seen), daemon=True
            )
            auditor.start()
            try:
                client = make_client(worker.data_endpoint)
                started = time.monotonic()
                await client.send(*bytes_observation(60_000_000))
                reply, _ = await client.receive(timeout_s=120)
                took_s = time.monotonic() - started
                assert (
                    reply.request_id == "huge" and reply.error_code == errors_pb2.ERROR_CODE_INVALID_ARGUMENT
                )
                assert "state" in reply.error_message, reply.error_message
                # A small request is served right after, and the leases live on a TTL longer.
                small, outputs = await client.call("double", {"x": np.ones(2, np.float32)})
                assert small.error_code == 0 and outputs["x"].tolist() == [2.0, 2.0]
                await asyncio.sleep(4.0)
            finally:
                stop.set()
                await asyncio.to_thread(auditor.join, 30)
            after = {s.model_id: (s.state, s.lease_id) for s in worker.pool.statuses()}
    assert seen.samples > 10 and seen.broker_errors == [], seen
    assert seen.competitor_grants == [], (
        f"the broker re-granted the worker's memory: {seen.competitor_grants}"
    )
    assert seen.double_promises == [], (
        f"{len(seen.double_promises)} samples, first: {seen.double_promises[:1]}"
    )
    assert seen.missing_worker_leases == [], (
        f"{len(seen.missing_worker_leases)}: {seen.missing_worker_leases[:1]}"
    )
    assert after["double"] == (ModelState.READY, before["double"])
    assert after["policy"] == (ModelState.READY, before["policy"])
    print(f"60 MB BYTES request answered in {took_s:.1f}s; {seen.samples} audit samples")
