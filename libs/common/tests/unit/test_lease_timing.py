"""The lease timing contract (docs/leases.md): the holder stops using a lease before the
broker may re-grant it, with room for at least two renewal attempts before that."""

from __future__ import annotations

import pytest

from loadmaster.common.config import LeaseTiming, ModelPoolSettings


@pytest.mark.parametrize("ttl_s", [0.1, 0.5, 3.0, 6.0, 15.0, 30.0, 300.0])
def test_the_holder_stops_before_the_broker_may_regrant(ttl_s: float) -> None:
    timing = LeaseTiming.for_ttl(ttl_s)
    assert timing.ttl_s == ttl_s
    assert timing.margin_s > 0
    assert timing.grace_s > 0
    assert 0 < timing.holder_deadline_s < timing.ttl_s < timing.regrant_after_s
    # A renewal attempt ends (its timeout) before the next one starts ...
    assert 0 < timing.renew_timeout_s <= timing.renew_every_s
    # ... and at least two whole attempts fit between a granted send and the holder's deadline.
    assert timing.attempts_before_deadline >= 2
    assert 2 * timing.renew_every_s + timing.renew_timeout_s <= timing.holder_deadline_s + 1e-9


def test_the_numbers_of_the_worker_default() -> None:
    """The numbers docs/leases.md states, for the model pool's default TTL."""
    ttl_s = ModelPoolSettings().lease_ttl_s
    timing = LeaseTiming.for_ttl(ttl_s)
    assert (ttl_s, timing.renew_every_s, timing.holder_deadline_s, timing.regrant_after_s) == (
        15.0,
        3.0,
        12.0,
        20.0,
    )
    assert timing.attempts_before_deadline == 3
    # Unloading after a lapse has regrant - deadline = 8 s before the memory can be re-granted.
    assert timing.regrant_after_s - timing.holder_deadline_s == pytest.approx(8.0)


def test_short_leases_keep_a_grace_of_at_least_one_second() -> None:
    timing = LeaseTiming.for_ttl(0.6)
    assert timing.grace_s == 1.0
    assert timing.regrant_after_s - timing.holder_deadline_s >= 1.0
