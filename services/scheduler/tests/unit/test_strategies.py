"""Each strategy's order, term by term: every test fails if its term were dead."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.common.ordering import (
    BatchRule,
    DeadlineTerms,
    InferenceRequest,
    Scope,
    make_ordering,
    register_policy,
)
from loadmaster.scheduler.domain import Request, RequestInfo
from loadmaster.scheduler.queues import RequestQueues

_arrivals = iter(range(10**9))


def _req(
    rid: str,
    *,
    at: float = 0.0,
    client: str | None = None,  # default: a client per request
    model: str = "m",
    priority: int = 0,
    urgency: float = 0.0,
    steps: int | None = None,
    budget_ms: float = 50.0,
    cadence_ms: float | None = None,
    backlog: int = 0,
) -> Request:
    info = RequestInfo(
        rid,
        model,
        client_id=client if client is not None else rid,
        priority=priority,
        urgency=urgency,
        steps_remaining=steps,
    )
    return Request(
        key=(1, rid),
        info=info,
        arrival=next(_arrivals),
        enqueued_at=at,
        deadline=at + 10.0,
        deadline_unix_ns=0,
        budget_ms=budget_ms,
        cadence_ms=cadence_ms,
        backlog=backlog,
    )


def _order(name: str, requests: list[Request], **kw: object) -> list[str]:
    q = RequestQueues(make_ordering(name, **kw))  # type: ignore[arg-type]
    for r in requests:
        q.push(r)
    out = []
    for model in sorted({r.model_id for r in requests}):
        while (r := q.pop(model)) is not None:
            out.append(r.request_id)
    return out


DEADLINE = ["model_deadline", "deadline_aware", "tiered_deadline"]


@pytest.mark.parametrize("name", DEADLINE)
def test_budget_orders_same_instant(name: str) -> None:
    assert _order(name, [_req("slow", budget_ms=80), _req("fast", budget_ms=20)]) == ["fast", "slow"]


@pytest.mark.parametrize("name", DEADLINE)
def test_cadence_tightens_slack(name: str) -> None:
    # same budget; the client that sends every 10 ms needs its answer before its next one
    reqs = [_req("lazy", budget_ms=50, cadence_ms=None), _req("quick", budget_ms=50, cadence_ms=10)]
    assert _order(name, reqs) == ["quick", "lazy"]
    # a cadence longer than the budget changes nothing: the budget binds
    reqs = [_req("a", budget_ms=50, cadence_ms=500), _req("b", budget_ms=40)]
    assert _order(name, reqs) == ["b", "a"]


@pytest.mark.parametrize("name", DEADLINE)
def test_urgency_shortens_slack(name: str) -> None:
    assert _order(name, [_req("calm", urgency=0.0), _req("urgent", urgency=1.0)]) == ["urgent", "calm"]


@pytest.mark.parametrize("name", DEADLINE)
def test_steps_remaining_few_left_first(name: str) -> None:
    reqs = [_req("many", steps=20), _req("none", steps=None), _req("last", steps=0)]
    assert _order(name, reqs)[0] == "last"
    assert _order(name, [_req("many", steps=8), _req("few", steps=2)]) == ["few", "many"]


@pytest.mark.parametrize("name", ["model_deadline", "deadline_aware"])
def test_priority_and_age_trade_off(name: str) -> None:
    # priority 2 at t=0 vs priority 0 arriving later: within 2 x 100 ms the p0 wins, after it the p2
    terms = DeadlineTerms(priority_step_ms=100.0)
    assert _order(name, [_req("p2", at=0.0, priority=2), _req("p0", at=0.1, priority=0)], terms=terms) == [
        "p0",
        "p2",
    ]
    assert _order(name, [_req("p2", at=0.0, priority=2), _req("p0", at=0.25, priority=0)], terms=terms) == [
        "p2",
        "p0",
    ]


@pytest.mark.parametrize("name", DEADLINE)
def test_age_older_first_all_else_equal(name: str) -> None:
    assert _order(name, [_req("new", at=0.02), _req("old", at=0.0)]) == ["old", "new"]


@pytest.mark.parametrize("name", DEADLINE)
def test_backlog_interleaves_clients(name: str) -> None:
    # client a has 3 queued, b arrives with 1: b's goes before a's 2nd and 3rd
    reqs = [_req(f"a{i}", client="a", backlog=i) for i in range(3)] + [_req("b0", client="b", at=0.001)]
    assert _order(name, reqs) == ["a0", "b0", "a1", "a2"]


def test_tiered_deadline_strict_tiers() -> None:
    # tiers [0, 1]: priority 0 | priority 1 | the rest; an old p1 never passes a new p0
    reqs = [
        _req("p1old", at=0.0, priority=1),
        _req("p0new", at=5.0, priority=0),
        _req("p3", at=0.0, priority=3),
    ]
    assert _order("tiered_deadline", reqs, tiers=[0, 1]) == ["p0new", "p1old", "p3"]
    # inside a tier: deadline order (urgency matters)
    reqs = [_req("x", priority=1), _req("y", priority=1, urgency=1.0)]
    assert _order("tiered_deadline", reqs, tiers=[0, 1]) == ["y", "x"]


def test_priority_tiered_fifo_inside_tier() -> None:
    reqs = [_req("a", priority=1), _req("b", priority=0, urgency=0.0), _req("c", priority=0, urgency=1.0)]
    assert _order("priority_tiered", reqs) == ["b", "c", "a"]  # urgency ignored: FIFO


def test_round_robin_rotates_clients() -> None:
    reqs = [_req(f"a{i}", client="a") for i in range(3)] + [_req(f"b{i}", client="b") for i in range(2)]
    reqs.append(_req("c0", client="c"))
    assert _order("round_robin", reqs) == ["a0", "b0", "c0", "a1", "b1", "a2"]


def test_round_robin_newcomer_starts_at_current_round() -> None:
    ordering = make_ordering("round_robin")
    q = RequestQueues(ordering)
    for i in range(4):
        q.push(_req(f"a{i}", client="a"))
    for _ in range(2):
        entry = q.peek_entry("m")
        assert entry is not None
        q.remove(entry[1].key)
        ordering.granted(entry[1], entry[0])
    q.push(_req("n0", client="new"))
    q.push(_req("n1", client="new"))
    order = [q.pop("m").request_id for _ in range(4)]  # type: ignore[union-attr]
    assert order == ["n0", "a2", "n1", "a3"]  # n0 joins the current round (1), not round 0


def test_batch_optimized_is_fifo_with_rule() -> None:
    ordering = make_ordering("batch_optimized", batch=BatchRule(max_batch_size=4, max_wait_s=0.01))
    assert ordering.batch == BatchRule(4, 0.01)
    assert _order("batch_optimized", [_req("a", priority=3), _req("b", priority=0)]) == ["a", "b"]


def test_scopes() -> None:
    assert make_ordering("model_deadline").scope is Scope.MODEL
    assert make_ordering("deadline_aware").scope is Scope.GLOBAL
    assert make_ordering("tiered_deadline").scope is Scope.GLOBAL


def test_custom_policy_replaces_slack_and_keeps_aging() -> None:
    seen: list[InferenceRequest] = []

    @register_policy("test-by-client")
    def by_client(r: InferenceRequest) -> float:
        seen.append(r)
        return 0.0 if r.client_id == "vip" else 100.0

    reqs = [_req("other", client="x", urgency=1.0), _req("vip", client="vip", at=0.05)]
    assert _order("model_deadline", reqs, policy="test-by-client") == ["vip", "other"]
    assert seen[0].latency_budget_ms == 50.0 and seen[0].urgency == 1.0
    # a waiting request still gains: 'other' arrived 200 ms before the vip
    reqs = [_req("other", client="x", at=0.0), _req("vip", client="vip", at=0.2)]
    assert _order("model_deadline", reqs, policy="test-by-client") == ["other", "vip"]


def test_unknown_names_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown strategy 'nope'"):
        make_ordering("nope")
    with pytest.raises(ValueError, match="unknown policy 'missing'"):
        make_ordering("model_deadline", policy="missing")
    with pytest.raises(ValueError, match="deadline_aware"):
        make_ordering("round_robin", policy="test-by-client")


def test_fake_clock_waiting_request_gains() -> None:
    """Age through a fake clock: a request admitted earlier keeps beating later ones."""
    clock = FakeClock()
    q = RequestQueues(make_ordering("model_deadline"))
    first = _req("first", at=clock.monotonic(), budget_ms=50)
    q.push(first)
    clock.advance(0.03)
    q.push(replace(_req("later", budget_ms=30), enqueued_at=clock.monotonic()))
    assert q.pop("m").request_id == "first"  # type: ignore[union-attr]


def test_a_clients_requests_keep_their_order() -> None:
    # the 2nd of a burst already has a (tiny) cadence; it must not pass the 1st
    reqs = [_req("c1", client="c", cadence_ms=None), _req("c2", client="c", cadence_ms=0.0, backlog=1)]
    assert _order("model_deadline", reqs) == ["c1", "c2"]


def test_forget_client_drops_per_client_state() -> None:
    deadline = make_ordering("model_deadline")
    deadline.key(_req("a", client="gone", at=5.0, budget_ms=1000))  # a late virtual deadline
    deadline.forget_client("gone")
    # without forgetting, the next request would be held back to the previous one's deadline
    assert deadline.key(_req("b", client="gone", at=0.0))[0] == pytest.approx(0.05)
    rr = make_ordering("round_robin")
    for i in range(3):
        rr.key(_req(f"r{i}", client="gone"))
    rr.forget_client("gone")
    assert rr.key(_req("again", client="gone"))[0] == 0


def test_slack_clamps_each_input_to_its_range() -> None:
    from loadmaster.common.ordering.deadline import slack_ms

    terms = DeadlineTerms(priority_step_ms=100.0, urgency_weight=0.5, steps_horizon=8, service_ms=10.0)
    assert slack_ms(_req("u", urgency=1.5), terms) == 25.0  # urgency above 1 counts as 1
    assert slack_ms(_req("u", urgency=-1.0), terms) == 50.0  # below 0 as 0
    assert slack_ms(_req("s", steps=20), terms) == 50.0  # past the horizon: no shortening
    assert slack_ms(_req("s", steps=2), terms) == pytest.approx(50.0 * 3 / 9)
    assert slack_ms(_req("c", cadence_ms=2.0), terms) == 10.0  # a burst: one service time
    assert slack_ms(_req("c", cadence_ms=30.0), terms) == 30.0
    assert slack_ms(_req("c", cadence_ms=500.0), terms) == 50.0  # the budget binds
    assert slack_ms(_req("p", priority=2, backlog=3), terms) == 50.0 + 200.0 + 30.0
