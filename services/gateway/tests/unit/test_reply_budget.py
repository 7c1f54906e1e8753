"""The per-peer byte budget of queued replies, with in-module trackers ZMQ would set done."""

from __future__ import annotations

from dataclasses import dataclass

from loadmaster.gateway.reply_budget import ReplyBudget

KIB = 1 << 10


@dataclass
class _Tracker:
    done: bool = False


def _send(budget: ReplyBudget, peer: bytes, nbytes: int) -> _Tracker | None:
    """What the edge does for one reply: admit, track when told to, record."""
    assert budget.admit(peer, nbytes)
    tracker = _Tracker() if budget.should_track(peer, nbytes) else None
    budget.queued(peer, nbytes, tracker)
    return tracker


def test_a_peer_that_takes_nothing_is_refused_past_its_budget_and_others_are_not() -> None:
    budget = ReplyBudget(1024 * KIB, track_bytes=64 * KIB)
    for _ in range(4):
        _send(budget, b"stuck", 256 * KIB)
    assert budget.queued_bytes(b"stuck") == 1024 * KIB
    assert not budget.admit(b"stuck", 1)
    assert budget.admit(b"other", 256 * KIB)


def test_taken_replies_free_the_budget() -> None:
    budget = ReplyBudget(512 * KIB, track_bytes=64 * KIB)
    first = _send(budget, b"p", 256 * KIB)
    second = _send(budget, b"p", 256 * KIB)
    assert first is not None and second is not None and not budget.admit(b"p", 256 * KIB)
    first.done = True
    assert budget.queued_bytes(b"p") == 256 * KIB and budget.admit(b"p", 256 * KIB)
    second.done = True
    budget.sweep()
    assert budget.queued_bytes(b"p") == 0 and budget.total_bytes == 0


def test_one_reply_larger_than_the_budget_goes_out_when_nothing_is_queued() -> None:
    budget = ReplyBudget(64 * KIB)
    tracker = _send(budget, b"p", 10 << 20)
    assert tracker is not None and not budget.admit(b"p", 1)
    tracker.done = True
    assert budget.admit(b"p", 10 << 20)


def test_small_replies_are_tracked_one_per_track_bytes_and_counted_together() -> None:
    budget = ReplyBudget(1 << 20, track_bytes=64 * KIB)
    trackers = [_send(budget, b"p", 1 * KIB) for _ in range(64)]
    tracked = [t for t in trackers if t is not None]
    assert len(tracked) == 1 and trackers[-1] is tracked[0]  # the 64th carries all 64 KiB
    assert budget.queued_bytes(b"p") == 64 * KIB
    tracked[0].done = True  # so every reply before it is gone too
    assert budget.queued_bytes(b"p") == 0


def test_sweep_forgets_peers_with_nothing_queued() -> None:
    budget = ReplyBudget(1 << 20)
    _send(budget, b"small", 100)  # untracked
    done = _send(budget, b"big", 128 * KIB)
    assert done is not None
    done.done = True
    budget.sweep()
    assert budget.total_bytes == 0
    assert not budget.should_track(b"small", 100)  # its untracked bytes were forgotten with it
