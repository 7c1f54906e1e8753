"""Property: per GPU at every instant, sum(live leases) + used_outside <= total - reserve, the
leased_mb books equal the leases stored, and the best-fit index holds every GPU's exact free
memory, whatever sequence of acquire / renew / release / holder crash / clock advance / reap /
re-register two broker replicas run on one real Redis.

The fast variant runs 1,000 steps; the slow one (`-m slow`) runs 10,000.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadmaster.common.clock import FakeClock
from loadmaster.common.errors import FailedPreconditionError, ResourceExhaustedError, UnavailableError
from loadmaster.gpu_broker.leases import AcquireRequest, GpuState, PlacementRequest
from loadmaster.gpu_broker.manager import LeaseManager
from loadmaster.gpu_broker.store import RedisLeaseStore, decode_alloc

NODES = {
    "a": [
        GpuState("a", 0, total_mb=8_000, reserve_mb=512, used_outside_mb=300),
        GpuState("a", 1, 4_000, 512),
    ],
    "b": [GpuState("b", 0, total_mb=24_000, reserve_mb=1_000)],
}
OPS = (
    "acquire",
    "acquire",
    "acquire",
    "renew",
    "release",
    "stale_release",
    "crash",
    "advance",
    "reap",
    "register",
    "replay",
)
STEPS = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 2**32)), min_size=1)


@dataclass
class Held:
    lease_id: str
    token: int
    holder: str
    request_id: str


@dataclass
class Model:
    held: list[Held] = field(default_factory=list)
    steps: int = 0


async def _check_invariant(raw: aioredis.Redis, prefix: str, now_ms: int) -> None:
    ids = await raw.zrange(f"{prefix}:expiry", 0, -1, withscores=True)
    pipe = raw.pipeline(transaction=True)
    for lease_id, _ in ids:
        pipe.hgetall(f"{prefix}:lease:{lease_id}")
    gpu_keys = [(node, g.index) for node, gpus in NODES.items() for g in gpus]
    for node, index in gpu_keys:
        pipe.hgetall(f"{prefix}:gpu:{node}:{index}")
    pipe.zrange(f"{prefix}:free", 0, -1, withscores=True)
    for node in NODES:
        pipe.zrange(f"{prefix}:free:{node}", 0, -1, withscores=True)
    replies = await pipe.execute()
    leases, gpus = replies[: len(ids)], replies[len(ids) : len(ids) + len(gpu_keys)]
    free_index, *node_indexes = replies[len(ids) + len(gpu_keys) :]
    booked: dict[tuple[str, int], int] = defaultdict(int)
    live: dict[tuple[str, int], int] = defaultdict(int)
    for (lease_id, score), fields in zip(ids, leases, strict=True):
        assert fields, f"lease {lease_id} is in the expiry set but not stored"
        assert int(fields["expires_ms"]) == int(score)
        for index, mb in decode_alloc(fields["alloc"]).items():
            booked[(fields["node"], index)] += mb
            if int(fields["expires_ms"]) > now_ms:
                live[(fields["node"], index)] += mb
    for (node, index), gpu in zip(gpu_keys, gpus, strict=True):
        capacity = int(gpu["total_mb"]) - int(gpu["reserve_mb"]) - int(gpu["used_outside_mb"])
        assert int(gpu["leased_mb"]) == booked[(node, index)], f"books of {node}/{index} drifted"
        assert live[(node, index)] <= capacity, f"{node}/{index} overcommitted"
        assert int(gpu["leased_mb"]) <= capacity, f"{node}/{index} overcommitted (unreaped included)"
    free = {
        f"{node} {index:010d}": int(gpu["total_mb"])
        - int(gpu["reserve_mb"])
        - int(gpu["used_outside_mb"])
        - int(gpu["leased_mb"])
        for (node, index), gpu in zip(gpu_keys, gpus, strict=True)
    }
    assert {member: int(score) for member, score in free_index} == free, "the best-fit index drifted"
    for node, indexed in zip(NODES, node_indexes, strict=True):
        expected = {m.split(" ")[1]: mb for m, mb in free.items() if m.split(" ")[0] == node}
        assert {member: int(score) for member, score in indexed} == expected, f"{node}'s index drifted"


async def _run(redis_url: str, steps: list[tuple[str, int]], model: Model) -> None:
    prefix = f"prop-{uuid.uuid4().hex[:10]}"
    clock = FakeClock()
    stores = [RedisLeaseStore.connect(redis_url, key_prefix=prefix) for _ in range(2)]
    replicas = [LeaseManager(s, clock=clock, default_ttl_s=10, default_reserve_mb=512) for s in stores]
    raw = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        for node, gpus in NODES.items():
            await replicas[0].register_node(node, gpus)
        for op, seed in steps:
            rng = random.Random(seed)
            broker = replicas[rng.randrange(2)]
            await _step(op, rng, broker, model)
            model.steps += 1
            await _check_invariant(raw, prefix, broker.now_ms())
        keys = [key async for key in raw.scan_iter(f"{prefix}:*")]
        if keys:
            await raw.delete(*keys)
    finally:
        await raw.aclose()
        for store in stores:
            await store.close()


async def _step(op: str, rng: random.Random, broker: LeaseManager, model: Model) -> None:
    clock = broker._clock
    assert isinstance(clock, FakeClock)
    pick = model.held[rng.randrange(len(model.held))] if model.held else None
    if op in ("acquire", "replay"):
        if op == "replay" and pick is not None:
            request_id, holder = pick.request_id, pick.holder
        else:
            request_id, holder = uuid.uuid4().hex[:8], f"h{rng.randrange(6)}"
        node = rng.choice(["", "a", "b"])
        gpus: tuple[int, ...] = ()
        if node == "a" and rng.random() < 0.5:
            gpus = (rng.randrange(2),)
        placement = PlacementRequest(
            mb=rng.choice([1, 100, 700, 2_000, 3_000, 7_000, 12_000]),
            node=node,
            gpus=gpus,
            allow_split=rng.random() < 0.3,
        )
        request = AcquireRequest(request_id, holder, placement, ttl_s=rng.choice([0.5, 5.0, 20.0]))
        try:
            lease = await broker.acquire(request)
        except (ResourceExhaustedError, FailedPreconditionError, UnavailableError):
            return
        except Exception as error:  # a replay with other parameters is refused; anything else is a bug
            assert "client_request_id" in str(error), error
            return
        if all(h.lease_id != lease.lease_id for h in model.held):
            model.held.append(Held(lease.lease_id, lease.fencing_token, holder, request_id))
    elif op == "renew" and pick is not None:
        try:
            await broker.renew(pick.lease_id, fencing_token=pick.token, ttl_s=rng.choice([0.5, 5.0]))
        except FailedPreconditionError:
            model.held.remove(pick)  # expired: the holder must stop using it
    elif op == "release" and pick is not None:
        await broker.release(pick.lease_id, fencing_token=pick.token)
        model.held.remove(pick)
    elif op == "stale_release" and pick is not None:
        try:  # a wrong token never frees a live lease
            released = await broker.release(pick.lease_id, fencing_token=pick.token + 1)
        except FailedPreconditionError:
            return
        assert released is False  # it had already expired
        model.held.remove(pick)
    elif op == "crash" and model.held:
        holder = rng.choice(model.held).holder  # the holder dies: its leases are never touched again
        model.held = [h for h in model.held if h.holder != holder]
    elif op == "advance":
        clock.advance(rng.choice([0.1, 1.0, 4.0, 11.0]))
    elif op == "reap":
        await broker.reap()
    elif op == "register":
        node = rng.choice(list(NODES))
        await broker.register_node(node, NODES[node])  # re-registering keeps every lease


def _property(redis_url: str, examples: int, steps_per_example: int) -> None:
    model = Model()

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        steps=st.lists(
            st.tuples(st.sampled_from(OPS), st.integers(0, 2**32)),
            min_size=steps_per_example,
            max_size=steps_per_example,
        )
    )
    def check(steps: list[tuple[str, int]]) -> None:
        model.held.clear()
        asyncio.run(_run(redis_url, steps, model))

    check()
    assert model.steps >= examples * steps_per_example


def test_invariant_holds_over_random_steps(redis_url: str) -> None:
    _property(redis_url, examples=10, steps_per_example=100)


@pytest.mark.slow
def test_invariant_holds_over_ten_thousand_random_steps(redis_url: str) -> None:
    _property(redis_url, examples=50, steps_per_example=200)
