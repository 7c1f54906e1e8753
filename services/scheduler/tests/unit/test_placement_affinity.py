"""Prefix affinity in placement: requests with the same `affinity_key` meet on one worker (the
one whose KV cache holds their prompt prefix), within room and a load slack, and without it
placement is what it was."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from loadmaster.scheduler import wire
from loadmaster.scheduler.domain import RequestInfo
from loadmaster.scheduler.placement import GrantCandidate, affinity_rank, pick_grant_worker
from loadmaster.v1 import scheduler_pb2

if TYPE_CHECKING:
    from conftest import MakeHarness

KEYS = [f"prefix-{i}" for i in range(40)]


def test_the_same_key_always_picks_the_same_worker_and_keys_spread_over_workers() -> None:
    rng = random.Random(1)
    candidates = [GrantCandidate("w1", 0), GrantCandidate("w2", 0)]
    chosen = {}
    for key in KEYS:
        picks = {pick_grant_worker(candidates, max_inflight=8, rng=rng, affinity_key=key) for _ in range(10)}
        assert len(picks) == 1, key
        chosen[key] = picks.pop()
        assert chosen[key] == max(("w1", "w2"), key=lambda w, k=key: affinity_rank(k, w))
    assert 10 <= sum(w == "w1" for w in chosen.values()) <= 30  # about half each


def test_a_third_worker_takes_only_keys_it_wins_the_others_stay() -> None:
    two = [GrantCandidate("w1", 0), GrantCandidate("w2", 0)]
    three = [*two, GrantCandidate("w3", 0)]
    moved = 0
    for key in KEYS:
        before = pick_grant_worker(two, max_inflight=8, affinity_key=key)
        after = pick_grant_worker(three, max_inflight=8, affinity_key=key)
        assert after in (before, "w3")
        moved += after == "w3"
    assert 0 < moved < len(KEYS) // 2 + 5


def test_affinity_yields_to_load_beyond_the_slack_and_to_a_full_worker() -> None:
    key = next(k for k in KEYS if max(("w1", "w2"), key=lambda w, k=k: affinity_rank(k, w)) == "w1")
    # w1 is the key's worker: it keeps the key while at most `slack` grants busier
    assert (
        pick_grant_worker(
            [GrantCandidate("w1", 2), GrantCandidate("w2", 0)], max_inflight=8, affinity_key=key
        )
        == "w1"
    )
    assert (
        pick_grant_worker(
            [GrantCandidate("w1", 3), GrantCandidate("w2", 0)], max_inflight=8, affinity_key=key
        )
        == "w2"
    )  # default slack: max_inflight // 4 = 2
    assert (
        pick_grant_worker(
            [GrantCandidate("w1", 3), GrantCandidate("w2", 0)],
            max_inflight=8,
            affinity_key=key,
            affinity_slack=3,
        )
        == "w1"
    )
    assert (
        pick_grant_worker(
            [GrantCandidate("w1", 1), GrantCandidate("w2", 0)], max_inflight=1, affinity_key=key
        )
        == "w2"
    )  # no room on w1
    assert pick_grant_worker([GrantCandidate("w1", 1)], max_inflight=1, affinity_key=key) is None


def test_same_prefix_requests_go_to_the_worker_holding_it_when_two_workers_serve_the_model(
    make_harness: MakeHarness,
) -> None:
    h = make_harness(max_inflight=lambda model_id: 8)
    h.worker("w1", ["m"], ready=["m"])
    h.worker("w2", ["m"], ready=["m"])
    h.worker("w3", ["m"])  # not READY: never granted
    # a conversation's turns, one after another: each lands where the first one ran
    for index in range(6):
        h.enqueue_batch([RequestInfo(f"turn-{index}", "m", affinity_key="system-a")])
        h.complete(f"turn-{index}")
    holder = h.grants()[0].worker_id
    assert [g.worker_id for g in h.grants()] == [holder] * 6
    # concurrent requests for the prefix: on the holder while it is at most 2 (8 // 4) grants
    # busier than the other worker, where least-inflight placement would alternate them
    h.enqueue_batch([RequestInfo(f"burst-{i}", "m", affinity_key="system-a") for i in range(4)])
    assert [g.worker_id for g in h.grants()[6:]] == [holder, holder, holder, ({"w1", "w2"} - {holder}).pop()]
    for i in range(4):
        h.complete(f"burst-{i}")
    # other prefixes use both workers, each always the same one
    for round_ in range(2):
        for key in KEYS[:12]:
            h.enqueue_batch([RequestInfo(f"{key}-{round_}", "m", affinity_key=key)])
            h.complete(f"{key}-{round_}")
    placed = {g.request_id: g.worker_id for g in h.grants()}
    assert {placed[f"{k}-0"] for k in KEYS[:12]} == {"w1", "w2"}
    assert all(placed[f"{k}-0"] == placed[f"{k}-1"] for k in KEYS[:12])
    h.check(settled=True)


def test_the_key_crosses_the_wire() -> None:
    info = scheduler_pb2.RequestInfo(request_id="r1", model_id="m", affinity_key="0123abcd")
    pb = scheduler_pb2.SessionRequest(enqueue=[info])
    assert wire.submission(pb).enqueues == [RequestInfo("r1", "m", affinity_key="0123abcd")]
