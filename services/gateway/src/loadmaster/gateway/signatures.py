"""Models' declared inputs and outputs for the front ends that map dicts onto them (openpi,
GR00T), cached: `ModelCatalog.signature` costs two gRPC calls, a robot sends tens of
observations a second."""

from __future__ import annotations

import asyncio

from loadmaster.common.clock import Clock, SystemClock
from loadmaster.gateway.catalog import ModelCatalog
from loadmaster.v1 import model_pool_pb2

__all__ = ["Signatures"]


class Signatures:
    """`get(model)`: the model's signature, fetched at most every `ttl_s` per model (an edited
    config.yaml takes effect at its next load, so a short cache is never staler than that)."""

    def __init__(self, catalog: ModelCatalog, *, ttl_s: float = 10.0, clock: Clock | None = None) -> None:
        self._catalog = catalog
        self._ttl_s = ttl_s
        self._clock: Clock = clock or SystemClock()
        self._cached: dict[str, tuple[float, model_pool_pb2.ModelSignature]] = {}
        self._fetching: dict[str, asyncio.Future[model_pool_pb2.ModelSignature]] = {}

    def cached(self, model_id: str) -> model_pool_pb2.ModelSignature | None:
        """The signature when a fresh one is cached (no await on the hot path), else None."""
        cached = self._cached.get(model_id)
        if cached is not None and self._clock.monotonic() - cached[0] < self._ttl_s:
            return cached[1]
        return None

    async def get(self, model_id: str) -> model_pool_pb2.ModelSignature:
        """The signature; `NotFoundError` for a model no worker knows, `UnavailableError` when
        the scheduler cannot be reached. Concurrent callers share one fetch."""
        now = self._clock.monotonic()
        cached = self._cached.get(model_id)
        if cached is not None and now - cached[0] < self._ttl_s:
            return cached[1]
        fetching = self._fetching.get(model_id)
        if fetching is None:
            fetching = self._fetching[model_id] = asyncio.ensure_future(self._fetch(model_id))
            fetching.add_done_callback(lambda _: self._fetching.pop(model_id, None))
        return await asyncio.shield(fetching)

    async def _fetch(self, model_id: str) -> model_pool_pb2.ModelSignature:
        signature = await self._catalog.signature(model_id)
        self._cached[model_id] = (self._clock.monotonic(), signature)
        if len(self._cached) > 1024:  # model names come from clients: keep the newest
            oldest = min(self._cached, key=lambda name: self._cached[name][0])
            del self._cached[oldest]
        return signature
