"""Bad requests are refused before any Redis call (this tier has no sockets)."""

from __future__ import annotations

import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.common.config import MetricsSettings, Settings
from loadmaster.common.errors import InvalidArgumentError
from loadmaster.gpu_broker.leases import AcquireRequest, GpuState, PlacementRequest
from loadmaster.gpu_broker.manager import LeaseManager
from loadmaster.gpu_broker.server import build
from loadmaster.gpu_broker.store import RedisLeaseStore


@pytest.fixture
def manager() -> LeaseManager:
    store = RedisLeaseStore.connect("redis://127.0.0.1:1/0", key_prefix="unit")  # never reached
    return LeaseManager(store, clock=FakeClock(), default_ttl_s=30, default_reserve_mb=0)


def acquire(**fields: object) -> AcquireRequest:
    placement = {k: fields.pop(k) for k in ("mb", "node", "gpus", "allow_split") if k in fields}
    placement.setdefault("mb", 100)
    return AcquireRequest(
        client_request_id=str(fields.pop("client_request_id", "r1")),
        holder=str(fields.pop("holder", "worker")),
        placement=PlacementRequest(**placement),  # type: ignore[arg-type]
        **fields,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (acquire(holder=""), "holder is required"),
        (acquire(mb=0), "mb must be > 0"),
        (acquire(gpus=(0,)), "give node as well"),
        (acquire(node="bad node"), "not a valid name"),
        (acquire(ttl_s=-1.0), "ttl_s must be between"),
        (acquire(ttl_s=float("nan")), "ttl_s must be between"),
        (acquire(ttl_s=10 * 86_400.0), "ttl_s must be between"),
        (acquire(labels={"k": "v" * 5000}), "labels are larger"),
        (acquire(client_request_id="x" * 300), "client_request_id is longer"),
    ],
)
async def test_bad_acquire(manager: LeaseManager, request_: AcquireRequest, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        await manager.acquire(request_)


async def test_bad_renew_release_and_register(manager: LeaseManager) -> None:
    with pytest.raises(InvalidArgumentError, match="fencing_token is required"):
        await manager.renew("lease", fencing_token=0)
    with pytest.raises(InvalidArgumentError, match="lease_id is required"):
        await manager.release("", fencing_token=3)
    gpu = GpuState(node="n", index=0, total_mb=1_000, reserve_mb=0)
    with pytest.raises(InvalidArgumentError, match="indexes repeat"):
        await manager.register_node("n", [gpu, gpu])
    with pytest.raises(InvalidArgumentError, match="total_mb must be > 0"):
        await manager.register_node("n", [GpuState(node="n", index=0, total_mb=0, reserve_mb=0)])
    with pytest.raises(InvalidArgumentError, match="is not a uint32"):
        await manager.register_node("n", [GpuState(node="n", index=-1, total_mb=1_000, reserve_mb=0)])


async def test_build_without_redis_url_says_what_to_set() -> None:
    settings = Settings(redis_url=None, metrics=MetricsSettings(enabled=False))
    with pytest.raises(ValueError, match="Redis is required: set REDIS_URL"):
        await build(settings)
