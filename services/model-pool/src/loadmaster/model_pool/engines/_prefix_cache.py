"""Prefix reuse in the transformers engine: transformers' own block sharing, counted and bounded.

transformers' continuous-batching cache already shares KV pages between requests
(`ContinuousBatchingConfig.allow_block_sharing`): every full page of a sequence gets a
content hash chained to its parent's, a finished request's hashed pages stay *cached*
(unreferenced, still holding their keys and values), and a new request's prompt is matched
page by page against those hashes before it is prefilled (`PagedAttentionCache.
search_prefix_match`). So a shared system prompt or the earlier turns of a chat are computed
once, at page granularity (`block_size` tokens; the last prompt token is always recomputed).

What it lacks, and this module adds by wrapping three methods of the cache the manager
builds (all three run on the manager's thread, so no lock is needed):

- counters: prefix lookups, hits, tokens reused and blocks evicted (`PrefixCacheStats`);
- a memory budget with LRU eviction: transformers keeps every cached page until the cache
  runs short and then evicts *all* of them at once, the hot system prompt included. With
  `max_cached_blocks` set, a finished request's pages that would push the cached set over
  the budget evict the least recently released ones first, tail pages of a prompt before its
  head (a chain is matched from its head, so an orphaned tail is worthless, a head is not).

    monitor = PrefixCacheMonitor(max_cached_blocks=256)
    monitor.attach(manager)        # before manager.start(): wraps the cache it creates
    monitor.stats()                # PrefixCacheStats, cumulative since load
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

__all__ = ["PrefixCacheMonitor", "PrefixCacheStats"]

log = logging.getLogger(__name__)

_WRAPPED = ("search_prefix_match", "evict_cached_blocks", "free_blocks", "cache_allocators")


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Cumulative since the model loaded (counters), and the pages cached now (a gauge)."""

    lookups: int = 0  # prompts matched against the cache (one per admitted request)
    hits: int = 0  # lookups that reused at least one page
    tokens_reused: int = 0  # prompt tokens whose KV came from the cache instead of a prefill
    blocks_evicted: int = 0  # cached pages given back to the free pool (budget or memory pressure)
    blocks_cached: int = 0  # pages held now only for reuse (no running request references them)


class PrefixCacheMonitor:
    """Counts prefix reuse in a transformers `ContinuousBatchingManager`'s cache and keeps its
    cached pages under `max_cached_blocks` (None: transformers' own policy, evict on pressure)."""

    def __init__(self, *, max_cached_blocks: int | None = None) -> None:
        if max_cached_blocks is not None and max_cached_blocks < 0:
            raise ValueError(f"max_cached_blocks: {max_cached_blocks} is negative")
        self._budget = max_cached_blocks
        self._cache: Any = None
        self._lookups = 0
        self._hits = 0
        self._tokens_reused = 0
        self._evicted = 0

    # ---- wiring -------------------------------------------------------------------

    def attach(self, manager: Any) -> None:
        """Instrument every cache `manager` builds (it builds one on its thread when started).
        A transformers without the hooks this relies on is served without counters, not refused."""
        create = getattr(manager, "_create_batch_processor", None)
        if create is None:
            log.warning("prefix cache: this transformers has no _create_batch_processor; no counters")
            return

        def create_and_instrument() -> Any:
            processor = create()
            self.instrument(processor.cache)
            return processor

        manager._create_batch_processor = create_and_instrument

    def instrument(self, cache: Any) -> None:
        """Wrap `cache`'s prefix match, pressure eviction and block release (idempotent)."""
        if self._cache is cache:
            return
        if not all(hasattr(cache, name) for name in _WRAPPED):
            log.warning("prefix cache: this transformers' cache lacks %s; no counters", ", ".join(_WRAPPED))
            return
        self._cache = cache
        search = cache.search_prefix_match
        evict_all = cache.evict_cached_blocks
        free = cache.free_blocks

        def search_prefix_match(request_id: str, prompt_ids: list[int]) -> int:
            reused = int(search(request_id, prompt_ids))
            self._lookups += 1
            if reused > 0:
                self._hits += 1
                self._tokens_reused += reused
            return reused

        def evict_cached_blocks() -> bool:
            before = self._cached_count()
            evicted = bool(evict_all())
            self._evicted += max(0, before - self._cached_count())
            return evicted

        def free_blocks(request_id: str, no_cache: bool = False) -> None:
            tables = [list(a.block_table.get(request_id, ())) for a in cache.cache_allocators.values()]
            free(request_id, no_cache)
            if self._budget is not None:
                try:  # on the manager's thread: an error here must not stop its loop
                    for allocator, table in zip(cache.cache_allocators.values(), tables, strict=True):
                        self._trim(allocator, table)
                except Exception:
                    log.exception("prefix cache: keeping cached pages under the budget failed")

        cache.search_prefix_match = search_prefix_match
        cache.evict_cached_blocks = evict_cached_blocks
        cache.free_blocks = free_blocks

    # ---- reading (any thread: plain ints, a snapshot) --------------------------------

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            lookups=self._lookups,
            hits=self._hits,
            tokens_reused=self._tokens_reused,
            blocks_evicted=self._evicted,
            blocks_cached=self._cached_count(),
        )

    # ---- internals (the manager's thread) -------------------------------------------

    def _cached_count(self) -> int:
        cache = self._cache
        if cache is None:
            return 0
        return sum(len(a.ledger.cached_blocks) for a in list(cache.cache_allocators.values()))

    def _trim(self, allocator: Any, released: list[int]) -> None:
        """Order the pages `released` just cached tail first (so a prompt's head outlives its
        tail), then evict from the least recently released end down to the budget."""
        cached: dict[int, None] = allocator.ledger.cached_blocks
        for block_id in reversed(released):
            if block_id in cached:
                del cached[block_id]
                cached[block_id] = None
        assert self._budget is not None
        excess = len(cached) - self._budget
        if excess <= 0:
            return
        victims = [block_id for block_id, _ in zip(cached, range(excess), strict=False)]
        ledger = allocator.ledger
        for block_id in victims:
            del cached[block_id]
            block_hash = ledger.block_to_hash.pop(block_id, None)
            if block_hash is not None and ledger.hash_to_block.get(block_hash) == block_id:
                del ledger.hash_to_block[block_hash]
        allocator.pool.free_blocks(allocator.index, victims)
        self._evicted += len(victims)
        log.debug("prefix cache: evicted %d blocks over the budget of %d", len(victims), self._budget)
