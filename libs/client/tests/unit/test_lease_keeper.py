"""`LeaseKeeper`: the holder's deadline counts from the send of the last granted call; a lease
past it is dropped and reported; a lease the broker lost is acquired again. The keeper's
thread runs for real here, against an in-memory broker double (no sockets)."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

import pytest

from loadmaster.client.lease_client import Lease, LeaseLostError
from loadmaster.client.lease_keeper import Held, LeaseKeeper
from loadmaster.common.config import LeaseTiming
from loadmaster.common.errors import LoadmasterError, ResourceExhaustedError, UnavailableError


def test_the_deadline_counts_from_the_send_and_only_moves_forward() -> None:
    timing = LeaseTiming.for_ttl(10.0)  # renew every 2 s, deadline 8 s after the send
    held = Held.granted(Lease("l", 1, {0: 100}, sent_monotonic=100.0), timing)
    assert (held.deadline, held.next_renew) == (108.0, 102.0)
    assert not held.due(101.9) and held.due(102.0)
    assert not held.due(100.9, early=True) and held.due(101.0, early=True)  # with another's renewal
    assert held.live(107.9) and not held.live(108.0) and held.lapsed(108.0)
    held.renewed(Lease("l", 1, {0: 100}, sent_monotonic=103.0))
    assert held.deadline == 111.0
    held.renewed(Lease("l", 1, {0: 100}, sent_monotonic=99.0))  # a late answer to an older send
    assert held.deadline == 111.0
    held.settling = True
    assert not held.live(104.0) and not held.lapsed(200.0) and not held.due(200.0, early=True)


class FakeBroker:
    """Thread-safe enough for one keeper thread: answers from its flags."""

    def __init__(self) -> None:
        self.renewals: list[str] = []
        self.acquired: list[tuple[int, tuple[int, ...]]] = []
        self.released: list[str] = []
        self.unreachable = False
        self.gone: set[str] = set()
        self.full = False
        self._ids = 0

    def grant(self, mb: int = 100) -> Lease:
        self._ids += 1
        return Lease(
            f"l{self._ids}", self._ids, {0: mb}, labels={"model": "m"}, sent_monotonic=time.monotonic()
        )

    async def acquire(
        self,
        *,
        mb: int,
        ttl_s: float,
        labels: Mapping[str, str],
        gpus: Sequence[int] | None = None,
        allow_split: bool = False,
        node: str | None = None,
    ) -> Lease:
        self.acquired.append((mb, tuple(gpus or ())))
        if self.full:
            raise ResourceExhaustedError("no room")
        return self.grant(mb)

    async def renew(self, lease: Lease, *, ttl_s: float) -> Lease:
        sent = time.monotonic()
        self.renewals.append(lease.lease_id)
        if self.unreachable:
            raise UnavailableError("unreachable")
        if lease.lease_id in self.gone:
            raise LeaseLostError(f"lease {lease.lease_id} is not live")
        return replace(lease, sent_monotonic=sent)

    async def release(self, lease: Lease) -> None:
        self.released.append(lease.lease_id)

    async def free_mb(self) -> dict[int, int]:
        return {}

    async def close(self) -> None:
        pass


def until(condition: object, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


@pytest.fixture
def keeper_of() -> object:
    keepers: list[LeaseKeeper] = []

    def make(broker: FakeBroker, **kwargs: object) -> tuple[LeaseKeeper, list[tuple[str, str]]]:
        events: list[tuple[str, str]] = []
        lock = threading.Lock()

        def lost(key: str, lease: Lease, error: LoadmasterError) -> None:
            with lock:
                events.append(("lost", f"{key}:{lease.lease_id}:{error.message}"))

        def replaced(key: str, old: Lease, new: Lease) -> None:
            with lock:
                events.append(("replaced", f"{key}:{old.lease_id}->{new.lease_id}"))

        keeper = LeaseKeeper(lambda: broker, on_lost=lost, on_replaced=replaced, **kwargs)  # type: ignore[arg-type]
        keeper.start()
        keepers.append(keeper)
        return keeper, events

    yield make
    for keeper in keepers:
        keeper.close()


def test_renewals_keep_a_lease_live_past_its_ttl(keeper_of: object) -> None:
    broker = FakeBroker()
    keeper, events = keeper_of(broker)  # type: ignore[operator]
    keeper.keep("m", broker.grant(), ttl_s=0.5)
    time.sleep(1.0)  # two TTLs: renewals every 0.1 s
    assert keeper.live("m") and events == [] and 4 <= len(broker.renewals) <= 11


def test_a_lease_no_renewal_reaches_lapses_before_its_ttl(keeper_of: object) -> None:
    broker = FakeBroker()
    broker.unreachable = True
    keeper, events = keeper_of(broker)  # type: ignore[operator]
    lease = broker.grant()
    keeper.keep("m", lease, ttl_s=0.5)
    until(lambda: events)
    lapsed_after = time.monotonic() - lease.sent_monotonic
    assert events[0][0] == "lost" and "no renewal succeeded" in events[0][1]
    assert 0.4 - 0.05 <= lapsed_after < 0.5 + LeaseTiming.for_ttl(0.5).grace_s
    assert not keeper.live("m") and keeper.lease("m") is None
    assert len(broker.renewals) >= 2  # it kept trying until the deadline


def test_a_lease_the_broker_lost_is_acquired_again(keeper_of: object) -> None:
    broker = FakeBroker()
    keeper, events = keeper_of(broker)  # type: ignore[operator]
    keeper.keep("m", broker.grant(250), ttl_s=0.5)
    broker.gone.add("l1")
    until(lambda: events)
    assert events == [("replaced", "m:l1->l2")]
    assert broker.acquired == [(250, (0,))]
    assert keeper.live("m") and keeper.lease("m").lease_id == "l2"  # type: ignore[union-attr]


def test_a_lease_that_cannot_be_had_again_is_lost(keeper_of: object) -> None:
    broker = FakeBroker()
    keeper, events = keeper_of(broker)  # type: ignore[operator]
    keeper.keep("m", broker.grant(), ttl_s=0.5)
    broker.full = True
    broker.gone.add("l1")
    until(lambda: events)
    assert events[0][0] == "lost" and "acquiring it again failed" in events[0][1]
    assert len(broker.acquired) >= 1 and not keeper.live("m")


def test_without_reacquire_a_lost_lease_is_reported_at_once(keeper_of: object) -> None:
    broker = FakeBroker()
    keeper, events = keeper_of(broker, reacquire=False)  # type: ignore[operator]
    keeper.keep("m", broker.grant(), ttl_s=0.5)
    broker.gone.add("l1")
    until(lambda: events)
    assert events[0][0] == "lost" and broker.acquired == []


def test_a_forgotten_lease_is_no_longer_renewed(keeper_of: object) -> None:
    broker = FakeBroker()
    keeper, events = keeper_of(broker)  # type: ignore[operator]
    keeper.keep("m", broker.grant(), ttl_s=0.5)
    until(lambda: broker.renewals)
    assert keeper.forget("m") is not None
    count = len(broker.renewals)
    time.sleep(0.3)
    assert len(broker.renewals) <= count + 1 and events == []  # one may have been in flight
