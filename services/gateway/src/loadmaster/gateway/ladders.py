"""Model ladders: an alias names an ordered list of models, and each request for it goes to one.

    choose(ladder, states, skip=...)
                              pure: the primary when READY; else the first READY fallback that
                              is not in `skip` (not when the ladder pins its primary); else the
                              primary (a cold load)
    LadderRouter.route(name)  the model a request for `name` goes to: `name` itself when it is
                              no alias; for an alias, `choose` over the fleet's model states

The fallback guard: while `models.allow_cloud_fallback` is false, remote rungs (models whose
backend is remote_openai: a hosted API) are skipped as fallbacks. A remote primary is served
all the same, and so is a request that names a remote model (it is no alias). The router asks
for the setting at each request, so a change at run time applies to the next request.

The states come from the catalog (the scheduler's ListWorkers). The router keeps the last look
for `max_age_s`, so a burst of alias requests costs the scheduler one call, not one each; any
fresh look (`observe`, e.g. from `GET /v1/models`) replaces it. When the catalog cannot be
reached, a request goes to the primary: the scheduler answers it as it would any request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass

from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.config import AliasSettings
from loadmaster.common.errors import LoadmasterError

__all__ = ["READY", "REMOTE_BACKENDS", "Ladder", "LadderRouter", "alias_states", "choose", "ladders_from"]

log = logging.getLogger(__name__)

READY = "READY"
DEFAULT_MAX_AGE_S = 0.2  # a READY model is seen at most this late; the scheduler gets <= 5 calls/s
REMOTE_BACKENDS = frozenset({"remote_openai"})  # rungs the cloud-fallback guard may skip


@dataclass(frozen=True, slots=True)
class Ladder:
    alias: str
    models: tuple[str, ...]  # the primary, then the fallbacks in order
    pin_primary: bool = False

    @property
    def primary(self) -> str:
        return self.models[0]


def ladders_from(aliases: Mapping[str, AliasSettings]) -> dict[str, Ladder]:
    return {
        alias: Ladder(alias, tuple(entry.models), pin_primary=entry.pin_primary)
        for alias, entry in aliases.items()
    }


def choose(ladder: Ladder, states: Mapping[str, str], *, skip: Collection[str] = ()) -> str:
    """The model a request for `ladder` goes to, given each model's state (READY, LOADING …);
    fallbacks in `skip` are passed over (the primary never is)."""
    if states.get(ladder.primary) == READY or ladder.pin_primary:
        return ladder.primary
    for fallback in ladder.models[1:]:
        if states.get(fallback) == READY and fallback not in skip:
            return fallback
    return ladder.primary


def alias_states(
    ladders: Mapping[str, Ladder], states: Mapping[str, str], *, skip: Collection[str] = ()
) -> dict[str, str]:
    """Each alias with the state of the model it would go to now (aliases of unlisted models left out)."""
    out: dict[str, str] = {}
    for alias, ladder in ladders.items():
        if not any(model in states for model in ladder.models):
            continue
        out[alias] = states.get(choose(ladder, states, skip=skip), "IDLE")
    return out


class LadderRouter:
    """Routes requests for aliases by the fleet's model states, looked up at most every `max_age_s`.

    `remote()` names the models known to be remote rungs, and `allow_cloud_fallback()` says
    whether they may be fallbacks; both are asked at each request."""

    def __init__(
        self,
        ladders: Mapping[str, Ladder],
        states: Callable[[], Awaitable[Mapping[str, str]]],
        *,
        clock: Clock | None = None,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        remote: Callable[[], Collection[str]] = frozenset,
        allow_cloud_fallback: Callable[[], bool] = lambda: True,
    ) -> None:
        self.ladders = dict(ladders)
        self._states = states
        self._remote = remote
        self._allow_cloud_fallback = allow_cloud_fallback
        self._clock: Clock = clock or SystemClock()
        self._max_age_s = max_age_s
        self._seen: Mapping[str, str] = {}
        self._seen_at: float | None = None
        self._looking: asyncio.Future[Mapping[str, str]] | None = None

    def is_alias(self, name: str) -> bool:
        return name in self.ladders

    def skipped(self) -> Collection[str]:
        """The fallbacks passed over now: the remote rungs while cloud fallback is off."""
        return () if self._allow_cloud_fallback() else self._remote()

    def observe(self, states: Mapping[str, str]) -> None:
        """A fresh look at the fleet's model states (from any caller)."""
        self._seen, self._seen_at = dict(states), self._clock.monotonic()

    async def route(self, name: str) -> str:
        ladder = self.ladders.get(name)
        if ladder is None:
            return name
        chosen = choose(ladder, await self._current(), skip=self.skipped())
        if chosen != ladder.primary:
            log.debug("alias %s: primary %s is cold, %s is warm", name, ladder.primary, chosen)
        return chosen

    async def _current(self) -> Mapping[str, str]:
        if self._seen_at is not None and self._clock.monotonic() - self._seen_at < self._max_age_s:
            return self._seen
        if self._looking is None or self._looking.done():  # one look at a time, shared
            self._looking = asyncio.ensure_future(self._look())
        return await asyncio.shield(self._looking)  # a caller that leaves does not cancel it

    async def _look(self) -> Mapping[str, str]:
        try:
            states = await self._states()
        except LoadmasterError as error:
            log.warning("model ladders: cannot see the models' states (%s); using primaries", error.message)
            states = {}  # kept like a look, so an unreachable catalog is not asked per request
        self.observe(states)
        return states
