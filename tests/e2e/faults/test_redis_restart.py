"""Restart Redis under lease traffic through two broker processes: no lease is granted twice,
capacity is never overcommitted, Acquire fails fast while Redis is down, and the brokers
recover by themselves (no restart) once it is back."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from loadmaster.cli.launcher import Suite, free_port_overrides
from loadmaster.cli.redis_server import EmbeddedRedis
from loadmaster.common.ports import free_port
from loadmaster.v1 import gpu_broker_pb2, gpu_broker_pb2_grpc

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "examples" / "loadmaster.yaml"
TOTAL_MB, RESERVE_MB, LEASE_MB = 4096, 0, 1000  # four leases fit at once, never five


@dataclass(frozen=True, slots=True)
class _Held:
    lease_id: str
    granted: float
    released: float


async def _client(address: str, stop_at: float, held: list[_Held], outcomes: dict[str, int]) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel)
        while time.monotonic() < stop_at:
            request = gpu_broker_pb2.AcquireRequest(
                client_request_id=uuid.uuid4().hex, holder="fault-test", mb=LEASE_MB, ttl_s=30
            )
            started = time.monotonic()
            try:
                reply = await stub.Acquire(request, timeout=5)
            except grpc.aio.AioRpcError as error:
                code = error.code().name
                outcomes[code] = outcomes.get(code, 0) + 1
                if code == "UNAVAILABLE":
                    assert time.monotonic() - started < 3.5, "Acquire did not fail fast while Redis was down"
                await asyncio.sleep(0.02)
                continue
            granted = time.monotonic()
            outcomes["OK"] = outcomes.get("OK", 0) + 1
            await asyncio.sleep(0.01)
            # Release is idempotent: a holder retries it through an outage, as a real one would.
            release = gpu_broker_pb2.ReleaseRequest(
                lease_id=reply.lease.lease_id, fencing_token=reply.lease.fencing_token
            )
            released = float("inf")  # until a Release succeeds, the lease counts as held
            last_failed: float | None = None
            for _ in range(100):
                attempt = time.monotonic()
                try:
                    outcome = await stub.Release(release, timeout=5)
                except grpc.aio.AioRpcError:
                    # Redis may have run the release and gone down before the broker had its
                    # reply: then a retry finds the lease gone (released=False), and the release
                    # took effect at one of the failed attempts, the last at the latest.
                    last_failed = attempt
                    await asyncio.sleep(0.05)
                    continue
                released = attempt if outcome.released or last_failed is None else last_failed
                break
            held.append(_Held(reply.lease.lease_id, granted, released))


def _max_concurrent(held: list[_Held]) -> tuple[int, list[_Held]]:
    """The most leases held at one instant, and those leases (for the failure message)."""
    events = sorted(
        [(h.granted, 1, i) for i, h in enumerate(held)]
        + [(h.released, -1, i) for i, h in enumerate(held) if h.released != float("inf")],
        key=lambda e: (e[0], e[1]),  # a release at the same instant as a grant comes first
    )
    alive: set[int] = set()
    peak, at_peak = 0, []
    for _, delta, index in events:
        if delta > 0:
            alive.add(index)
        else:
            alive.discard(index)
        if len(alive) > peak:
            peak, at_peak = len(alive), [held[i] for i in sorted(alive)]
    return peak, at_peak


def test_redis_restart_under_lease_traffic(tmp_path: Path) -> None:
    (tmp_path / "redis").mkdir()
    # A data_dir of our own survives stop/start, so the AOF carries the leases across the restart.
    redis = EmbeddedRedis(port=free_port(), appendonly=True, data_dir=str(tmp_path / "redis")).start()
    brokers: list[Suite] = []
    try:
        for index in range(2):
            overrides = free_port_overrides()
            overrides["redis_url"] = redis.url
            overrides["gpu_broker"]["reserve_mb"] = RESERVE_MB
            overrides["gpu_broker"]["declared"] = {"local": [{"index": 0, "total_mb": TOTAL_MB}]}
            overrides["metrics"]["enabled"] = False
            broker = Suite(
                CONFIG, overrides=overrides, log_dir=tmp_path / f"broker-{index}", services=("gpu-broker",)
            )
            broker.start(timeout_s=60)
            brokers.append(broker)
        addresses = [b.settings.gpu_broker.address for b in brokers]

        held: list[_Held] = []
        outcomes: dict[str, int] = {}
        restarted_at: list[float] = []

        async def traffic() -> None:
            stop_at = time.monotonic() + 9
            clients = [
                asyncio.create_task(_client(addresses[i % 2], stop_at, held, outcomes)) for i in range(6)
            ]
            await asyncio.sleep(2.5)
            await asyncio.to_thread(redis.stop, timeout_s=5)  # SIGTERM: Redis flushes its AOF
            await asyncio.sleep(1.5)
            await asyncio.to_thread(redis.start)
            restarted_at.append(time.monotonic())
            await asyncio.gather(*clients)

        asyncio.run(traffic())

        lease_ids = [h.lease_id for h in held]
        assert len(lease_ids) == len(set(lease_ids)), "a lease id was granted twice"
        peak, at_peak = _max_concurrent(held)
        assert peak <= TOTAL_MB // LEASE_MB, (
            f"GPU memory was overcommitted (Redis back at {restarted_at}): {at_peak}"
        )
        assert outcomes.get("UNAVAILABLE", 0) > 0, f"the outage was not noticed: {outcomes}"
        recovered = [h.granted - restarted_at[0] for h in held if h.granted > restarted_at[0]]
        assert recovered, f"the brokers did not recover after Redis came back: {outcomes}"
        assert min(recovered) < 3.0, "the first grant after the restart took more than 3 s"
        for broker in brokers:
            assert all(p.process.poll() is None for p in broker.processes), "a broker died"
    finally:
        for broker in brokers:
            broker.stop()
        redis.stop()
