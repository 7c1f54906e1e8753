"""`PrefixCacheMonitor` over a stand-in for transformers' paged cache: transformers' real
`BlockLedger` (the hashes, reference counts and cached pages) with a pool and allocator that
only record what they are given. Counting, LRU order (tail pages before head pages) and the
budget are decided here; the real cache is exercised in tests/integration/test_prefix_reuse.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from transformers.generation.continuous_batching.cache_allocators.cache_allocator import BlockLedger

from loadmaster.model_pool.engines._prefix_cache import PrefixCacheMonitor, PrefixCacheStats


@dataclass
class _Pool:
    freed: list[int] = field(default_factory=list)

    def free_blocks(self, index: int, block_ids: list[int]) -> None:
        self.freed.extend(block_ids)


@dataclass
class _Allocator:
    pool: _Pool
    index: int = 0
    ledger: BlockLedger = field(default_factory=BlockLedger)
    block_table: dict[str, list[int]] = field(default_factory=dict)

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:  # as transformers does
        freed = [b for b in self.block_table.pop(request_id, []) if self.ledger.release(b, no_cache)]
        self.pool.free_blocks(self.index, freed)


class _Cache:
    """The three methods the monitor wraps, with transformers' semantics over the allocator."""

    def __init__(self) -> None:
        self.pool = _Pool()
        self.allocator = _Allocator(self.pool)
        self.cache_allocators = {"full_attention": self.allocator}
        self.matches: dict[str, int] = {}

    def run(self, request_id: str, blocks: list[int]) -> None:
        """A request that wrote full, hashed pages `blocks` (hash = 1000 + block id)."""
        self.allocator.block_table[request_id] = list(blocks)
        for block_id in blocks:
            self.allocator.ledger.register_new_hash(block_id, 1000 + block_id)

    def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        return self.matches.get(request_id, 0)

    def evict_cached_blocks(self) -> bool:
        evicted = self.allocator.ledger.evict_cached_blocks()
        self.pool.free_blocks(0, evicted)
        return bool(evicted)

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        for allocator in self.cache_allocators.values():
            allocator.free_blocks(request_id, no_cache)


def _monitored(budget: int | None) -> tuple[PrefixCacheMonitor, _Cache]:
    monitor = PrefixCacheMonitor(max_cached_blocks=budget)
    cache = _Cache()
    monitor.instrument(cache)
    return monitor, cache


def test_lookups_hits_and_reused_tokens_are_counted() -> None:
    monitor, cache = _monitored(None)
    cache.matches = {"warm": 128}
    assert cache.search_prefix_match("cold", [1] * 200) == 0
    assert cache.search_prefix_match("warm", [1] * 200) == 128
    assert monitor.stats() == PrefixCacheStats(lookups=2, hits=1, tokens_reused=128)


def test_without_a_budget_finished_pages_stay_cached_until_pressure_evicts_them_all() -> None:
    monitor, cache = _monitored(None)
    cache.run("a", [1, 2, 3])
    cache.free_blocks("a")
    assert monitor.stats().blocks_cached == 3 and cache.pool.freed == []
    assert cache.evict_cached_blocks()
    assert monitor.stats().blocks_evicted == 3
    assert monitor.stats().blocks_cached == 0 and sorted(cache.pool.freed) == [1, 2, 3]


def test_a_budget_evicts_least_recently_released_pages_tail_first() -> None:
    monitor, cache = _monitored(4)
    cache.run("old", [1, 2, 3])  # a prompt of three pages: 1 is its head
    cache.free_blocks("old")
    assert cache.pool.freed == [] and monitor.stats().blocks_cached == 3
    cache.run("new", [7, 8, 9])
    cache.free_blocks("new")
    # two pages over the budget: the old prompt's tail (3, then 2) goes, its head stays
    assert cache.pool.freed == [3, 2]
    ledger = cache.allocator.ledger
    assert list(ledger.cached_blocks) == [1, 9, 8, 7]
    assert 1003 not in ledger.hash_to_block and 1002 not in ledger.hash_to_block  # no stale match
    assert ledger.hash_to_block[1001] == 1
    assert monitor.stats().blocks_evicted == 2 and monitor.stats().blocks_cached == 4


def test_pages_still_referenced_are_never_evicted() -> None:
    monitor, cache = _monitored(0)
    cache.run("a", [1, 2])
    cache.allocator.ledger.acquire(1)  # a second request shares page 1
    cache.free_blocks("a")
    assert cache.pool.freed == [2]  # page 1 is still in use: not cached, not evicted
    assert monitor.stats().blocks_evicted == 1 and monitor.stats().blocks_cached == 0


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="max_cached_blocks"):
        PrefixCacheMonitor(max_cached_blocks=-1)


def test_a_cache_without_the_hooks_is_left_alone_and_counts_nothing() -> None:
    monitor = PrefixCacheMonitor(max_cached_blocks=2)
    monitor.instrument(object())  # another transformers: served, just not counted
    monitor.attach(object())
    assert monitor.stats() == PrefixCacheStats()
