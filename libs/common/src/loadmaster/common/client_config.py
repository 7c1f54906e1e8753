"""Client profiles and cooldowns (`clients.profiles`, `clients.cooldown`): per-client defaults
for generation requests and a bound on how fast one client may send them. Sections of the one
configuration object (`loadmaster.common.config.Settings.clients`), imported from here; the gateway applies
them (loadmaster.gateway.profiles, docs/client-profiles.md)."""

from __future__ import annotations

from pydantic import Field, model_validator

from loadmaster.common.settings_section import Section as _Section

__all__ = ["ClientMatchSettings", "ClientProfileSettings", "CooldownSettings", "check_profiles"]


class ClientMatchSettings(_Section):
    """Whose requests a profile shapes: exactly one of a client id (`x_client_id`, else the
    request's `user`, else the API key's name), an API key's name, or a tenant."""

    client_id: str | None = Field(default=None, min_length=1)
    api_key: str | None = Field(default=None, min_length=1)
    tenant: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _exactly_one(self) -> ClientMatchSettings:
        given = [name for name in ("client_id", "api_key", "tenant") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of client_id, api_key, tenant (got {', '.join(given) or 'none'})"
            )
        return self

    @property
    def key(self) -> tuple[str, str]:
        """(kind, value): what the profile is looked up by."""
        for name in ("client_id", "api_key", "tenant"):
            value = getattr(self, name)
            if value is not None:
                return name, value
        raise AssertionError("validated: one matcher is set")


class CooldownSettings(_Section):
    """How fast one client may send generation requests: `rate_per_s` with bursts of up to
    `burst` (0: max(1, rate)); a request above that is refused with 429 and `Retry-After` (when
    the next one would pass), and with `cooldown_s` > 0 the client's requests are all refused
    for that long from then on (or until its rate allows one, if that is later). `rate_per_s`
    0: no cooldown."""

    rate_per_s: float = Field(default=0.0, ge=0)
    burst: int = Field(default=0, ge=0)
    cooldown_s: float = Field(default=0.0, ge=0)

    @property
    def enabled(self) -> bool:
        return self.rate_per_s > 0

    @property
    def capacity(self) -> float:
        return float(self.burst or max(1.0, self.rate_per_s))


class ClientProfileSettings(_Section):
    """Defaults for one client's generation requests; a request's own values win. `model` is a
    model or an alias (used when the request names none); `system_prompt` is put first in a
    chat that has no system message; `cooldown` replaces `clients.cooldown` for these clients."""

    match: ClientMatchSettings
    model: str | None = Field(default=None, min_length=1)
    priority: int | None = Field(default=None, ge=0, le=255)
    deadline_ms: float | None = Field(default=None, gt=0)
    system_prompt: str | None = Field(default=None, min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    cooldown: CooldownSettings | None = None


def check_profiles(profiles: dict[str, ClientProfileSettings]) -> None:
    """Two profiles may not match the same client id, key or tenant (ValueError naming both)."""
    seen: dict[tuple[str, str], str] = {}
    for name, profile in profiles.items():
        key = profile.match.key
        if key in seen:
            raise ValueError(
                f"profiles '{seen[key]}' and '{name}' both match {key[0]} '{key[1]}'; one profile per match"
            )
        seen[key] = name
