"""Client profiles and cooldowns (`clients.profiles`, `clients.cooldown`; docs/client-profiles.md).

    clients = ClientPolicy(lambda: settings.clients, clock=clock)
    profile = clients.profile(client_id="robot-7", api_key="planner", tenant="lab")
    clients.charge("robot-7", profile)        # raises CooldownError (429, retry_after_s)
    request = apply_profile(request, profile)  # the profile's defaults where the request has none

A profile is found by the request's client id first (`x_client_id`, else `user`, else the API
key's name), then by its API key's name, then by its tenant. Its defaults fill what the request
left out: the model (or alias), priority, deadline, max tokens, and a system prompt put first in
a chat that has none; whatever the request gives wins.

A cooldown is a rate per client (GCRA, the token bucket's exact twin: one number per client, the
time its next request is due): `rate_per_s` with bursts of `burst`. A request above it is refused
with `CooldownError` saying when the next one would pass (`Retry-After`); with `cooldown_s`, the
client is refused for that long from then on. Refused requests are not charged, so a client that
retries after `Retry-After` gets through. At most `max_tracked_clients` clients are remembered
(least recently seen go first: one forgets a flood only after that many other clients spoke).

The settings are read through a callable at each request, so settings changed at run time apply
to the next request; the lookup index is rebuilt when the `clients` settings object is replaced.
Pure decisions with an injected clock: no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from loadmaster.common.client_config import ClientProfileSettings, CooldownSettings
from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.config import ClientsSettings
from loadmaster.common.errors import ResourceExhaustedError
from loadmaster.gateway.generation import GenerationRequest
from loadmaster.gateway.generation_items import ChatTurn

__all__ = ["ClientPolicy", "CooldownError", "Profile", "apply_profile"]

_SYSTEM_ROLES = ("system", "developer")


class CooldownError(ResourceExhaustedError):
    """A client sent requests faster than its cooldown allows; it may try again after `retry_after_s`."""

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    settings: ClientProfileSettings


@dataclass(slots=True)
class _Pace:
    """One client's cooldown state: when its next request is due (GCRA's theoretical arrival
    time) and until when it is cooling down."""

    due: float
    until: float = 0.0


class ClientPolicy:
    def __init__(self, clients: Callable[[], ClientsSettings], *, clock: Clock | None = None) -> None:
        self._clients = clients
        self._clock: Clock = clock or SystemClock()
        self._indexed: ClientsSettings | None = None
        self._index: dict[tuple[str, str], Profile] = {}
        self._paces: OrderedDict[str, _Pace] = OrderedDict()  # least recently seen first

    def profile(self, *, client_id: str, api_key: str = "", tenant: str = "") -> Profile | None:
        """The client's profile: by client id, else by API key name, else by tenant."""
        clients = self._clients()
        if not clients.profiles:
            return None
        if clients is not self._indexed:
            self._index = {
                settings.match.key: Profile(name, settings) for name, settings in clients.profiles.items()
            }
            self._indexed = clients
        index = self._index
        return (
            index.get(("client_id", client_id))
            or (index.get(("api_key", api_key)) if api_key else None)
            or (index.get(("tenant", tenant)) if tenant else None)
        )

    def charge(self, client_id: str, profile: Profile | None) -> None:
        """Count one request of `client_id`, or raise `CooldownError` when it is above its rate."""
        clients = self._clients()
        cooldown = profile.settings.cooldown if profile and profile.settings.cooldown else clients.cooldown
        if not cooldown.enabled:
            return
        now = self._clock.monotonic()
        pace = self._paces.get(client_id)
        if pace is None:
            pace = self._paces[client_id] = _Pace(due=now)
            while len(self._paces) > clients.max_tracked_clients:
                self._paces.popitem(last=False)
        else:
            self._paces.move_to_end(client_id)
        if pace.until > now:
            raise _refusal(client_id, cooldown, pace.until - now, cooling=True)
        interval = 1.0 / cooldown.rate_per_s
        due = max(pace.due, now) + interval
        wait = due - cooldown.capacity * interval - now  # > 0: the bucket is empty
        if wait > 1e-9:
            if cooldown.cooldown_s > 0:
                pace.until = now + max(cooldown.cooldown_s, wait)
                raise _refusal(client_id, cooldown, pace.until - now, cooling=True)
            raise _refusal(client_id, cooldown, wait, cooling=False)
        pace.due = due


def _refusal(client_id: str, cooldown: CooldownSettings, wait_s: float, *, cooling: bool) -> CooldownError:
    what = f"cooling down for {cooldown.cooldown_s:g} s" if cooling else "over its rate"
    return CooldownError(
        f"client '{client_id}' sent more than {cooldown.rate_per_s:g} requests/s "
        f"(bursts of {cooldown.capacity:g}) and is {what}; retry after {math.ceil(wait_s)} s",
        retry_after_s=wait_s,
    )


def apply_profile(request: GenerationRequest, profile: Profile | None) -> GenerationRequest:
    """`request` with the profile's defaults where it has none of its own."""
    if profile is None:
        return request
    settings = profile.settings
    changes: dict[str, object] = {}
    if not request.model and settings.model:
        changes["model"] = settings.model
    if request.priority is None and settings.priority is not None:
        changes["priority"] = settings.priority
    if request.deadline_ms is None and settings.deadline_ms is not None:
        changes["deadline_ms"] = settings.deadline_ms
    if request.max_tokens is None and settings.max_tokens is not None:
        changes["max_tokens"] = settings.max_tokens
    messages = request.messages
    if (
        settings.system_prompt
        and messages is not None
        and not any(turn.role in _SYSTEM_ROLES for turn in messages)
    ):
        changes["messages"] = (ChatTurn("system", settings.system_prompt), *messages)
    return dataclasses.replace(request, **changes) if changes else request  # type: ignore[arg-type]
