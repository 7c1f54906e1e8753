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


def test_grant_ties_broken_by_power_of_two_choices() -> None:
    import random

    rng = random.Random(7)
    candidates = [GrantCandidate("a", 0, reported_load=5), GrantCandidate("b", 0, reported_load=0)]
    # with two tied candidates both are drawn: the less loaded by its own report wins
    assert {pick_grant_worker(candidates, max_inflight=2, rng=rng) for _ in range(20)} == {"b"}
    many = [GrantCandidate(f"w{i}", 0, reported_load=i) for i in range(8)]
    picks = {pick_grant_worker(many, max_inflight=2, rng=rng) for _ in range(200)}
    assert len(picks) > 3 and "w7" not in picks  # spread, but never the most loaded of a pair
    # least inflight still decides first; a full worker is never picked
    assert pick_grant_worker([GrantCandidate("a", 1), GrantCandidate("b", 0, 9)], max_inflight=2) == "b"
    assert pick_grant_worker([GrantCandidate("a", 2)], max_inflight=2) is None


def test_load_goes_where_memory_is_free_else_evictable() -> None:
    from loadmaster.scheduler.placement import LoadCandidate, pick_load_worker

    small = LoadCandidate("small", loaded=0, failed=False, free_mb=100)
    big = LoadCandidate("big", loaded=3, failed=False, free_mb=4000)
    assert pick_load_worker([small, big], vram_mb=500) == "big"  # only big fits
    assert pick_load_worker([small, big], vram_mb=50) == "big"  # both fit: most free
    unknown_busy = LoadCandidate("busy", loaded=2, failed=False, evictable=0)
    unknown_idle = LoadCandidate("idle", loaded=2, failed=False, evictable=2)
    assert pick_load_worker([unknown_busy, unknown_idle], vram_mb=50) == "idle"  # can make room
    failed = LoadCandidate("failed", loaded=0, failed=True, free_mb=9000)
    assert pick_load_worker([failed, unknown_busy], vram_mb=50) == "busy"


def test_a_less_loaded_candidate_ends_an_earlier_tie() -> None:
    candidates = [GrantCandidate("a", 1), GrantCandidate("b", 1), GrantCandidate("c", 0)]
    assert {pick_grant_worker(candidates, max_inflight=2) for _ in range(20)} == {"c"}
    full = [GrantCandidate("a", 2), GrantCandidate("b", 2)]  # tied, but at max_inflight: no room
    assert pick_grant_worker(full, max_inflight=2) is None
