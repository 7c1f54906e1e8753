"""How dispatch credits (the per-gateway shares) follow demand when load moves from one
gateway to another (issue 28 item 4), on the core with a fake clock: 8 slots, 4 credits,
a 1 s credit window. Characterizes the mechanism as it is; the real-process timing is
still to be measured (see the h-shares report)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import Harness, MakeHarness

A, B = 1, 2


@pytest.fixture
def h(make_harness: MakeHarness) -> Harness:
    h = make_harness(max_inflight=lambda model_id: 8, dispatch_credits=4, credit_window_s=1.0)
    h.core.accept_credits(A)
    h.core.accept_credits(B)
    h.worker("w1", ["m"], ready=["m"])
    h.enqueue("a0", session=A)  # gateway A alone: its 4 credits are lent at once
    h.complete("a0", session=A)
    assert sorted(s for s, _ in h.lent.values()) == [A] * 4
    return h


def _shares(h: Harness) -> dict[int, int]:
    out = {A: 0, B: 0}
    for session, _ in h.lent.values():
        out[session] += 1
    return out


def test_load_that_fits_the_free_slots_never_moves_the_credits(h: Harness) -> None:
    """B's 4 concurrent requests fit the 4 unlent slots: nothing waits, so A's idle credits
    are never revoked and B, though now the sole user, gets none (the limit is reached)."""
    for step in range(50):  # 10 s of B-only traffic in 0.2 s steps
        ids = [f"b{step}.{i}" for i in range(4)]
        h.enqueue(*ids, session=B)
        assert set(ids) <= set(h.granted_ids())
        for r in ids:
            h.complete(r, session=B)
        h.clock.advance(0.2)
    assert _shares(h) == {A: 4, B: 0}


def test_load_that_must_wait_moves_the_credits_after_the_pause(h: Harness) -> None:
    """B's 5th concurrent request waits: A's credits are revoked (A returns idle ones at
    once) and lending pauses for the window; B's next use after the pause, with A quiet for
    a window, gets all 4 credits. Bound: window (pause) + one B request cycle."""
    ids = [f"b{i}" for i in range(5)]
    h.enqueue(*ids, session=B)
    assert "b4" not in h.granted_ids()  # waits
    assert sorted(h.revoked) == sorted(h.lent)
    for cid in list(h.revoked):
        h.return_credit(cid, session=A)
    assert "b4" in h.granted_ids()
    for r in ids:
        h.complete(r, session=B)
    assert _shares(h) == {A: 0, B: 0}  # paused
    h.clock.advance(1.01)  # past the pause, A quiet for over a window
    h.enqueue("b5", session=B)
    h.complete("b5", session=B)
    assert _shares(h) == {A: 0, B: 4}


def test_with_load_on_both_gateways_the_first_keeps_its_credits_and_the_second_gets_none(
    h: Harness,
) -> None:
    """A 50/50 split (A runs 2 on its credits, B 2 through the queue, fitting the free
    slots): the shares stay 4/0; two recent users mean nothing new is lent."""
    credits = [cid for cid, (s, _) in h.lent.items() if s == A]
    for step in range(50):  # 10 s in 0.2 s steps
        runs = [f"a{step}.{i}" for i in range(2)]
        for r, cid in zip(runs, credits, strict=False):
            h.run(r, cid, session=A)
        ids = [f"b{step}.{i}" for i in range(2)]
        h.enqueue(*ids, session=B)
        assert set(ids) <= set(h.granted_ids())
        for r in ids:
            h.complete(r, session=B)
        for r in runs:
            h.complete(r, session=A)
        h.clock.advance(0.2)
    assert _shares(h) == {A: 4, B: 0}
