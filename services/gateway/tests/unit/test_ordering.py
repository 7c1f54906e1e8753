from __future__ import annotations

import random

import pytest

from loadmaster.gateway.ordering import ReplyOrderer


def test_replies_leave_in_arrival_order_per_key_whatever_order_they_complete_in() -> None:
    sent: list[tuple[str, int]] = []
    orderer: ReplyOrderer[tuple[str, int]] = ReplyOrderer(sent.append)
    tickets = {(key, i): orderer.take(key) for i in range(50) for key in ("a", "b")}
    completion = list(tickets)
    random.Random(7).shuffle(completion)
    for key, i in completion:
        orderer.complete(tickets[(key, i)], (key, i))
    assert [i for key, i in sent if key == "a"] == list(range(50))
    assert [i for key, i in sent if key == "b"] == list(range(50))
    assert orderer.outstanding == 0


def test_a_slow_reply_holds_back_only_its_own_key() -> None:
    sent: list[str] = []
    orderer: ReplyOrderer[str] = ReplyOrderer(sent.append)
    slow = orderer.take(("client", "sleep"))
    later_same_key = orderer.take(("client", "sleep"))
    other_key = orderer.take(("client", "double"))
    orderer.complete(later_same_key, "second")
    orderer.complete(other_key, "other")
    assert sent == ["other"]
    orderer.complete(slow, "first")
    assert sent == ["other", "first", "second"]


def test_completing_a_ticket_twice_is_refused() -> None:
    orderer: ReplyOrderer[str] = ReplyOrderer(lambda _: None)
    ticket = orderer.take("k")
    keep_lane_open = orderer.take("k")
    orderer.complete(ticket, "x")
    with pytest.raises(ValueError, match="twice"):
        orderer.complete(ticket, "x")
    orderer.complete(keep_lane_open, "y")
