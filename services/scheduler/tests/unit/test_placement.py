"""Placement decisions over plain values."""

from __future__ import annotations

from loadmaster.scheduler.placement import GrantCandidate, LoadCandidate, pick_grant_worker, pick_load_worker


def test_grant_goes_to_least_inflight_with_room() -> None:
    candidates = [GrantCandidate("a", 2), GrantCandidate("b", 1), GrantCandidate("c", 3)]
    assert pick_grant_worker(candidates, max_inflight=3) == "b"
    assert pick_grant_worker([GrantCandidate("a", 2)], max_inflight=2) is None
    assert pick_grant_worker([], max_inflight=2) is None


def test_load_goes_to_fewest_loaded_avoiding_a_recent_failure() -> None:
    assert pick_load_worker([LoadCandidate("a", 3, False), LoadCandidate("b", 1, False)]) == "b"
    assert pick_load_worker([LoadCandidate("a", 3, False), LoadCandidate("b", 1, True)]) == "a"
    assert pick_load_worker([LoadCandidate("b", 1, True)]) == "b"
    assert pick_load_worker([]) is None
