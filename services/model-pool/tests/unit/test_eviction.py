"""The eviction policy over plain values, with a fake clock's `now`."""

from __future__ import annotations

from loadmaster.common.clock import FakeClock
from loadmaster.model_pool.eviction import (
    EvictionCounters,
    Incoming,
    Resident,
    WarmBump,
    choose_victim,
    idle_models,
    next_idle_deadline,
    no_room_message,
    plan_evictions,
)


def resident(model_id: str, **fields: object) -> Resident:
    values: dict[str, object] = {
        "vram_mb": 400,
        "priority": 1,
        "pinned": False,
        "inflight": 0,
        "last_used": 900.0,
        "loaded_at": 800.0,
    }
    values.update(fields)
    return Resident(model_id=model_id, **values)  # type: ignore[arg-type]


def test_lowest_priority_first_then_least_recently_used() -> None:
    clock = FakeClock()
    residents = [
        resident("a", priority=1, last_used=950.0),
        resident("b", priority=0, last_used=990.0),
        resident("c", priority=0, last_used=960.0),
        resident("d", priority=1, last_used=910.0),
    ]
    incoming = Incoming("x", priority=1)
    assert choose_victim(residents, incoming=incoming, now=clock.monotonic()).victim == "c"
    rest = [r for r in residents if r.model_id != "c"]
    assert choose_victim(rest, incoming=incoming, now=clock.monotonic()).victim == "b"
    rest = [r for r in rest if r.model_id != "b"]
    assert choose_victim(rest, incoming=incoming, now=clock.monotonic()).victim == "d"


def test_never_pinned_busy_or_higher_priority() -> None:
    residents = [
        resident("pinned", pinned=True, priority=0, last_used=0.0),
        resident("busy", inflight=2, priority=0, last_used=0.0),
        resident("important", priority=5, last_used=0.0),
    ]
    choice = choose_victim(residents, incoming=Incoming("x", priority=1), now=1000.0)
    assert choice.victim is None
    assert choice.waiting == ("busy",)
    assert choice.refused == {"pinned": "pinned", "important": "priority 5 > 1"}
    assert choice.worth_waiting
    message = no_room_message("x", 400, choice, residents)
    assert (
        "pinned (pinned)" in message and "busy (busy)" in message and "important (priority 5 > 1)" in message
    )


def test_only_pinned_left_is_not_worth_waiting() -> None:
    choice = choose_victim([resident("p", pinned=True)], incoming=Incoming("x", priority=9), now=1000.0)
    assert choice.victim is None and not choice.worth_waiting
    assert "nothing can be evicted" in no_room_message("x", 10, choice, [])


def test_min_resident_anti_thrash() -> None:
    clock = FakeClock(start=1000.0)
    young = resident("young", loaded_at=999.5, last_used=999.5, min_resident_s=2.0)
    choice = choose_victim([young], incoming=Incoming("x", priority=1), now=clock.monotonic())
    assert choice.victim is None and choice.waiting == ("young",)
    clock.advance(1.5)
    assert choose_victim([young], incoming=Incoming("x", priority=1), now=clock.monotonic()).victim == "young"


def test_gpu_scoped_loads_only_evict_models_on_those_gpus() -> None:
    residents = [resident("gpu0", gpus=(0,), last_used=1.0), resident("gpu1", gpus=(1,), last_used=2.0)]
    assert choose_victim(residents, incoming=Incoming("x", 1, gpus=(1,)), now=1000.0).victim == "gpu1"
    assert choose_victim(residents, incoming=Incoming("x", 1), now=1000.0).victim == "gpu0"


def test_models_settling_are_waited_for_never_chosen() -> None:
    residents = [
        resident("loading", state="loading", last_used=0.0),
        resident("unloading", state="unloading", pinned=True, last_used=0.0),
        resident("loading-pinned", state="loading", pinned=True),
    ]
    choice = choose_victim(residents, incoming=Incoming("x", priority=1), now=1000.0)
    assert choice.victim is None and choice.worth_waiting
    # a pinned model on its way out still gives memory back; one on its way in never will
    assert choice.waiting == ("loading", "unloading")
    assert choice.refused == {"loading-pinned": "pinned"}
    message = no_room_message("x", 400, choice, residents)
    assert "loading (loading)" in message and "unloading (unloading)" in message
    # keep-alive never unloads a model that is not READY
    assert idle_models([resident("loading", state="loading", keep_alive_s=1.0)], now=1000.0) == []


def test_the_incoming_model_is_never_its_own_victim() -> None:
    assert choose_victim([resident("x")], incoming=Incoming("x", 1), now=1000.0).victim is None


def test_keep_alive() -> None:
    clock = FakeClock(start=1000.0)
    residents = [
        resident("idle", keep_alive_s=30.0, last_used=1000.0),
        resident("forever", keep_alive_s=None, last_used=0.0),
        resident("pinned", keep_alive_s=1.0, pinned=True, last_used=0.0),
        resident("busy", keep_alive_s=1.0, inflight=1, last_used=0.0),
    ]
    assert idle_models(residents, now=clock.monotonic()) == []
    assert next_idle_deadline(residents) == 1030.0
    clock.advance(29.9)
    assert idle_models(residents, now=clock.monotonic()) == []
    clock.advance(0.1)
    assert idle_models(residents, now=clock.monotonic()) == ["idle"]
    assert next_idle_deadline([r for r in residents if r.model_id != "idle"]) is None


def test_counters_count_evictions_by_reason_and_reloads() -> None:
    counters = EvictionCounters()
    assert counters.loaded("a") is False
    counters.evicted("a", "capacity")
    counters.evicted("a", "idle")
    counters.evicted("b", "capacity")
    assert counters.loaded("a") is True
    assert counters.loaded("a") is False  # a second load without eviction is not a reload
    assert counters.of("a") == 2
    assert counters.by_reason() == {"capacity": 2, "idle": 1}
    assert counters.reloads == {"a": 1}


def test_a_plan_evicts_nothing_when_every_eviction_together_would_not_make_room() -> None:
    residents = [resident("a", vram_mb=200, gpus=(0,)), resident("b", vram_mb=100, gpus=(0,))]
    # 100 free + 300 evictable = 400 < 500: no victims, nothing worth waiting for.
    plan = plan_evictions(residents, incoming=Incoming("x", 1), mb=500, free_mb={0: 100}, now=1000.0)
    assert plan.victims == () and not plan.worth_waiting and not plan.fits_now
    # With 200 free it takes both (the fewest that fit), in the policy's order.
    plan = plan_evictions(residents, incoming=Incoming("x", 1), mb=500, free_mb={0: 200}, now=1000.0)
    assert set(plan.victims) == {"a", "b"} and plan.gpu == 0


def test_a_plan_takes_the_fewest_victims_on_one_gpu() -> None:
    residents = [
        resident("a0", vram_mb=100, gpus=(0,), last_used=100.0),
        resident("b0", vram_mb=100, gpus=(0,), last_used=200.0),
        resident("c1", vram_mb=300, gpus=(1,), last_used=300.0),
    ]
    plan = plan_evictions(residents, incoming=Incoming("x", 1), mb=350, free_mb={0: 100, 1: 50}, now=1000.0)
    assert plan.victims == ("c1",) and plan.gpu == 1
    # The incoming model must go on GPU 0: both of its models, least recently used first.
    pinned = Incoming("x", 1, gpus=(0,))
    plan = plan_evictions(residents, incoming=pinned, mb=250, free_mb={0: 100, 1: 50}, now=1000.0)
    assert plan.victims == ("a0", "b0") and plan.gpu == 0


def test_a_plan_waits_only_when_the_busy_models_would_make_room() -> None:
    busy = resident("busy", vram_mb=400, gpus=(0,), inflight=1)
    plan = plan_evictions([busy], incoming=Incoming("x", 1), mb=300, free_mb={0: 0}, now=1000.0)
    assert plan.victims == () and plan.worth_waiting and plan.choice.waiting == ("busy",)
    plan = plan_evictions([busy], incoming=Incoming("x", 1), mb=500, free_mb={0: 0}, now=1000.0)
    assert not plan.worth_waiting  # even once idle, 400 MB is not 500
    pinned = resident("p", vram_mb=400, gpus=(0,), pinned=True)
    plan = plan_evictions([pinned], incoming=Incoming("x", 1), mb=300, free_mb={0: 0}, now=1000.0)
    assert plan.victims == () and not plan.worth_waiting and plan.choice.refused == {"p": "pinned"}


def test_a_split_lease_frees_its_own_share_per_gpu() -> None:
    split = resident("s", vram_mb=600, gpus=(0, 1), mb_per_gpu=((0, 200), (1, 400)))
    assert (split.frees_on(0), split.frees_on(1), split.frees_on(2)) == (200, 400, 0)
    plan = plan_evictions([split], incoming=Incoming("x", 1), mb=300, free_mb={0: 0, 1: 0}, now=1000.0)
    assert plan.victims == ("s",) and plan.gpu == 1


def test_a_load_that_may_split_evicts_for_room_over_all_gpus_together() -> None:
    residents = [resident("a", vram_mb=300, gpus=(0,)), resident("b", vram_mb=300, gpus=(1,))]
    free = {0: 200, 1: 200}
    # 900 MB fits no single GPU even with every eviction; spread over both, evicting a suffices.
    assert (
        plan_evictions(residents, incoming=Incoming("x", 1), mb=900, free_mb=free, now=1000.0).victims == ()
    )
    plan = plan_evictions(residents, incoming=Incoming("x", 1), mb=700, free_mb=free, now=1000.0, split=True)
    assert len(plan.victims) == 1 and plan.gpu is None
    plan = plan_evictions(residents, incoming=Incoming("x", 1), mb=1100, free_mb=free, now=1000.0, split=True)
    assert plan.victims == () and not plan.worth_waiting  # 1000 MB at most: evict nothing


# ---- the warm bump (docs/vram-gate.md) -----------------------------------------------


def test_the_warm_bump_keeps_a_model_in_use_until_its_bound() -> None:
    bump = WarmBump(until=1005.0, idle_s=0.25)
    incoming = Incoming("x", priority=1)
    used_just_now = resident("warm", last_used=999.9)  # idle between two requests of a stream
    busy = resident("busy", inflight=1)
    for r in (used_just_now, busy):
        choice = choose_victim([r], incoming=incoming, now=1000.0, bump=bump)
        assert choice.victim is None and choice.waiting == (r.model_id,)  # its requests go first
        plan = plan_evictions([r], incoming=incoming, mb=400, free_mb={0: 0}, now=1000.0, bump=bump)
        assert plan.victims == () and plan.worth_waiting
        # The bound: from `until` on, it goes (drained first when busy), so the cold model
        # does not starve behind a model that never stops being used.
        assert choose_victim([r], incoming=incoming, now=1005.0, bump=bump).victim == r.model_id
        plan = plan_evictions([r], incoming=incoming, mb=400, free_mb={0: 0}, now=1005.0, bump=bump)
        assert plan.victims == (r.model_id,)
    # Without the bump a model idle for a moment goes at once, and a busy one is waited for.
    assert choose_victim([used_just_now], incoming=incoming, now=1000.0).victim == "warm"
    assert choose_victim([busy], incoming=incoming, now=1005.0).waiting == ("busy",)


def test_the_warm_bump_is_among_equal_priority_and_in_use_models_only() -> None:
    bump = WarmBump(until=1005.0, idle_s=0.25)
    idle = resident("idle", last_used=999.0)  # its last request finished a second ago
    assert choose_victim([idle], incoming=Incoming("x", 1), now=1000.0, bump=bump).victim == "idle"
    lower = resident("lower", priority=0, last_used=999.9)  # in use, but of lower priority
    assert choose_victim([lower], incoming=Incoming("x", 1), now=1000.0, bump=bump).victim == "lower"
    higher = resident("higher", priority=2, inflight=1)
    choice = choose_victim([higher], incoming=Incoming("x", 1), now=1006.0, bump=bump)
    assert choice.victim is None and "higher" in choice.refused  # never, bound or not
