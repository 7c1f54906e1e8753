"""Placement math: best fit, proportional split, all-or-nothing, rounding."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadmaster.common.errors import NotFoundError
from loadmaster.gpu_broker.leases import (
    GpuState,
    Placement,
    PlacementRequest,
    best_fit,
    describe_free,
    plan_placement,
    split_proportional,
)


def gpu(node: str, index: int, free: int, *, reserve: int = 0, outside: int = 0) -> GpuState:
    """A GPU of 100_000 MB with `free` MB left for leases."""
    total = 100_000
    return GpuState(
        node=node,
        index=index,
        total_mb=total,
        reserve_mb=reserve,
        used_outside_mb=outside,
        leased_mb=total - reserve - outside - free,
    )


def test_free_subtracts_reserve_outside_and_leases_and_never_goes_negative() -> None:
    g = GpuState(node="a", index=0, total_mb=16_000, reserve_mb=500, used_outside_mb=1_500, leased_mb=4_000)
    assert g.capacity_mb == 14_000
    assert g.free_mb == 10_000
    shrunk = GpuState(node="a", index=0, total_mb=1_000, reserve_mb=500, used_outside_mb=0, leased_mb=4_000)
    assert shrunk.free_mb == 0


def test_best_fit_takes_the_fullest_gpu_that_still_fits() -> None:
    gpus = [gpu("a", 0, 8_000), gpu("a", 1, 3_000), gpu("b", 0, 2_000), gpu("b", 1, 5_000)]
    chosen = best_fit(gpus, 2_500)
    assert chosen is not None
    assert (chosen.node, chosen.index) == ("a", 1)
    assert best_fit(gpus, 8_001) is None


def test_best_fit_breaks_ties_by_node_then_index() -> None:
    gpus = [gpu("b", 0, 4_000), gpu("a", 1, 4_000), gpu("a", 0, 4_000)]
    chosen = best_fit(gpus, 1_000)
    assert chosen is not None
    assert (chosen.node, chosen.index) == ("a", 0)


def test_exact_fit_is_accepted() -> None:
    assert best_fit([gpu("a", 0, 4_096)], 4_096) is not None


def test_plan_respects_node_and_gpu_constraints() -> None:
    gpus = [gpu("a", 0, 8_000), gpu("a", 1, 3_000), gpu("b", 0, 2_000)]
    assert plan_placement(gpus, PlacementRequest(mb=1_000, node="a", gpus=(0,))) == Placement("a", {0: 1_000})
    assert plan_placement(gpus, PlacementRequest(mb=1_000, node="b")) == Placement("b", {0: 1_000})
    assert plan_placement(gpus, PlacementRequest(mb=2_500, node="b")) is None


def test_unknown_node_or_gpu_is_not_found() -> None:
    gpus = [gpu("a", 0, 8_000)]
    with pytest.raises(NotFoundError, match="node 'zz' is not registered"):
        plan_placement(gpus, PlacementRequest(mb=1, node="zz"))
    with pytest.raises(NotFoundError, match="has no GPU 3"):
        plan_placement(gpus, PlacementRequest(mb=1, node="a", gpus=(0, 3)))


def test_split_is_used_only_when_no_single_gpu_fits() -> None:
    gpus = [gpu("a", 0, 6_000), gpu("a", 1, 2_000)]
    assert plan_placement(gpus, PlacementRequest(mb=5_000, allow_split=True)) == Placement("a", {0: 5_000})
    assert plan_placement(gpus, PlacementRequest(mb=7_000)) is None


def test_split_is_proportional_to_free_memory() -> None:
    gpus = [gpu("a", 0, 6_000), gpu("a", 1, 2_000)]
    placement = plan_placement(gpus, PlacementRequest(mb=7_000, allow_split=True))
    assert placement == Placement("a", {0: 5_250, 1: 1_750})


def test_split_stays_on_one_node_and_packs_the_tightest_node() -> None:
    gpus = [gpu("a", 0, 3_000), gpu("a", 1, 3_000), gpu("b", 0, 2_500), gpu("b", 1, 2_500)]
    # 4_500 MB fits neither single GPU; both nodes could take it split: b is tighter.
    placement = plan_placement(gpus, PlacementRequest(mb=4_500, allow_split=True))
    assert placement == Placement("b", {0: 2_250, 1: 2_250})
    # 5_500 MB fits only node a (6_000 free), never a + b together.
    placement = plan_placement(gpus, PlacementRequest(mb=5_500, allow_split=True))
    assert placement is not None and placement.node == "a"
    assert plan_placement(gpus, PlacementRequest(mb=6_001, allow_split=True)) is None


def test_split_is_all_or_nothing() -> None:
    assert split_proportional({0: 1_000, 1: 999}, 2_000) is None
    assert split_proportional({0: 1_000, 1: 1_000}, 2_000) == {0: 1_000, 1: 1_000}
    assert split_proportional({0: 0, 1: 0}, 1) is None
    assert split_proportional({0: 5}, 0) is None


def test_split_rounding_gives_the_remainder_to_the_largest_fractions() -> None:
    # 10 MB over 3 equal GPUs: 3.33 each; one of them gets the extra MB, never more than its free.
    assert split_proportional({0: 3, 1: 4, 2: 3}, 10) == {0: 3, 1: 4, 2: 3}
    shares = split_proportional({0: 7, 1: 7, 2: 7}, 10)
    assert shares is not None and sorted(shares.values()) == [3, 3, 4]


def test_split_drops_gpus_that_get_nothing() -> None:
    assert split_proportional({0: 1_000_000, 1: 1}, 10) == {0: 10}


@settings(max_examples=300, deadline=None)
@given(
    free=st.dictionaries(st.integers(0, 15), st.integers(0, 200_000), min_size=1, max_size=8),
    fraction=st.floats(0.0, 1.0),
)
def test_split_never_overcommits_and_is_exact(free: dict[int, int], fraction: float) -> None:
    total_free = sum(free.values())
    mb = max(1, int(total_free * fraction))
    shares = split_proportional(free, mb)
    if total_free < mb:
        assert shares is None
        return
    assert shares is not None
    assert sum(shares.values()) == mb
    for index, share in shares.items():
        assert 0 < share <= free[index]
        assert abs(share - mb * free[index] / total_free) < 1


@settings(max_examples=200, deadline=None)
@given(
    frees=st.lists(st.integers(0, 50_000), min_size=1, max_size=6),
    mb=st.integers(1, 120_000),
    allow_split=st.booleans(),
)
def test_any_plan_fits_the_snapshot(frees: list[int], mb: int, allow_split: bool) -> None:
    gpus = [gpu("a" if i % 2 else "b", i, free) for i, free in enumerate(frees)]
    placement = plan_placement(gpus, PlacementRequest(mb=mb, allow_split=allow_split))
    by_key = {(g.node, g.index): g for g in gpus}
    if placement is None:
        assert all(g.free_mb < mb for g in gpus)
        return
    assert sum(placement.mb_per_gpu.values()) == mb
    assert allow_split or len(placement.mb_per_gpu) == 1
    for index, share in placement.mb_per_gpu.items():
        assert share <= by_key[(placement.node, index)].free_mb


def test_describe_free_names_each_gpu_and_its_capacity() -> None:
    text = describe_free([gpu("a", 0, 1_024, reserve=512), gpu("a", 1, 0)])
    assert text == "a/0=1024 of 99488 MB, a/1=0 of 100000 MB"
    assert describe_free([]) == "no GPUs registered"
    assert describe_free([gpu("a", i, 1) for i in range(40)], limit=2).endswith("… 38 more")
