"""API keys and guardrail rules as the admin plane stores them, and the effective sets that
the configuration file and the stored changes make together (pure; docs/admin.md).

Keys. The YAML's `gateway.auth.api_keys` seed them; a stored record of the same name wins
(a warning names the key when the two differ). A revoked key stays stored as a tombstone, so
the YAML's entry of that name does not come back at the next start. A rotated key keeps its
old SHA-256 valid until `until_unix_s` (its grace). Expiry is checked per call by the
`Authenticator`, so an expired key is refused with that reason.

Guardrails. The YAML's `blocked_words` and `blocked_patterns` seed them. A rule's id is made
from its kind and text, so the same word has the same id wherever it was added, and
removing a YAML rule stores a tombstone under its id.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from loadmaster.common.gateway_config import ApiKeySettings
from loadmaster.common.runtime_config import describe

__all__ = [
    "MAX_RULE_CHARS",
    "GraceKey",
    "GuardrailRecord",
    "KeyRecord",
    "Rules",
    "effective_keys",
    "effective_rules",
    "key_view",
    "parse_key_record",
    "parse_rule_record",
    "rule_id",
]

log = logging.getLogger(__name__)

MAX_RULE_CHARS = 1024


class GraceKey(BaseModel):
    """A rotated-out key that stays valid until `until_unix_s`."""

    model_config = ConfigDict(extra="forbid")

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    until_unix_s: float


class KeyRecord(ApiKeySettings):
    """A key as stored: the configured fields, its rotation grace and its history."""

    grace: list[GraceKey] = Field(default_factory=list)
    revoked_unix_s: float | None = None
    created_unix_s: float = 0.0
    updated_unix_s: float = 0.0
    source: Literal["api", "config"] = "api"

    @property
    def revoked(self) -> bool:
        return self.revoked_unix_s is not None


class GuardrailRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    kind: Literal["word", "pattern"]
    value: str = Field(min_length=1, max_length=MAX_RULE_CHARS)
    created_unix_s: float = 0.0
    created_by: str = ""
    source: Literal["api", "config"] = "api"
    removed_unix_s: float | None = None

    @field_validator("value")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be blank")
        return value

    def check(self) -> GuardrailRecord:
        """`self`, or `ValueError` when a pattern does not compile."""
        if self.kind == "pattern":
            try:
                re.compile(self.value)
            except re.error as error:
                raise ValueError(f"value: not a regular expression: {error}") from None
        return self


def rule_id(kind: str, value: str) -> str:
    return "g-" + hashlib.sha256(f"{kind}\0{value}".encode()).hexdigest()[:12]


def parse_key_record(name: str, raw: Mapping[str, Any]) -> KeyRecord | None:
    try:
        return KeyRecord.model_validate(raw)
    except ValidationError as error:
        log.warning("admin plane: stored key '%s' is not valid (%s); ignored", name, describe(error))
        return None


def parse_rule_record(rule: str, raw: Mapping[str, Any]) -> GuardrailRecord | None:
    try:
        return GuardrailRecord.model_validate(raw).check()
    except (ValidationError, ValueError) as error:
        problem = describe(error) if isinstance(error, ValidationError) else str(error)
        log.warning("admin plane: stored guardrail '%s' is not valid (%s); ignored", rule, problem)
        return None


def configured_record(key: ApiKeySettings) -> KeyRecord:
    return KeyRecord(**key.model_dump(), source="config")


def effective_keys(
    configured: Sequence[ApiKeySettings], stored: Mapping[str, Mapping[str, Any]], *, now_unix_s: float
) -> tuple[list[ApiKeySettings], dict[str, KeyRecord]]:
    """The keys to serve (each grace key as an entry of its own, until its grace ends) and
    every key record by name, revoked ones included (what `keys list` shows)."""
    records: dict[str, KeyRecord] = {key.name: configured_record(key) for key in configured}
    for name, raw in stored.items():
        record = parse_key_record(name, raw)
        if record is not None:
            records[name] = record
    serve: list[ApiKeySettings] = []
    fields = set(ApiKeySettings.model_fields)
    for record in records.values():
        if record.revoked:
            continue
        entry = ApiKeySettings(**record.model_dump(include=fields))
        serve.append(entry)
        for old in record.grace:
            if old.until_unix_s > now_unix_s:
                until = old.until_unix_s
                if entry.expires_unix_s is not None:
                    until = min(until, entry.expires_unix_s)
                serve.append(entry.model_copy(update={"sha256": old.sha256, "expires_unix_s": until}))
    return serve, records


def stored_differs(configured: ApiKeySettings, record: KeyRecord) -> bool:
    """The YAML's entry and the stored record say different things (so the stored one wins)."""
    fields = set(ApiKeySettings.model_fields)
    return configured.model_dump() != record.model_dump(include=fields) or record.revoked


def key_view(record: KeyRecord, *, now_unix_s: float) -> dict[str, Any]:
    """A key as `keys list` and the audit log show it: never the key, its hash cut short."""
    state = "revoked" if record.revoked else "active"
    if not record.revoked and record.expires_unix_s is not None and record.expires_unix_s <= now_unix_s:
        state = "expired"
    return {
        "name": record.name,
        "state": state,
        "scopes": list(record.scopes),
        "rate_per_s": record.rate_per_s,
        "burst": record.burst,
        "tenant": record.tenant,
        "expires_unix_s": record.expires_unix_s,
        "sha256_prefix": record.sha256[:12],
        "grace": [
            {"sha256_prefix": g.sha256[:12], "until_unix_s": g.until_unix_s}
            for g in record.grace
            if g.until_unix_s > now_unix_s
        ],
        "source": record.source,
        "created_unix_s": record.created_unix_s,
        "updated_unix_s": record.updated_unix_s,
        "revoked_unix_s": record.revoked_unix_s,
    }


@dataclass(frozen=True, slots=True)
class Rules:
    """The guardrail rules in force, and every rule by id (removed ones included)."""

    words: tuple[str, ...]
    patterns: tuple[str, ...]
    records: Mapping[str, GuardrailRecord]


def configured_rules(words: Sequence[str], patterns: Sequence[str]) -> dict[str, GuardrailRecord]:
    out: dict[str, GuardrailRecord] = {}
    for kind, values in (("word", words), ("pattern", patterns)):
        for value in values:
            if value:
                ident = rule_id(kind, value)
                out[ident] = GuardrailRecord(id=ident, kind=kind, value=value, source="config")  # type: ignore[arg-type]
    return out


def effective_rules(
    words: Sequence[str], patterns: Sequence[str], stored: Mapping[str, Mapping[str, Any]]
) -> Rules:
    records = configured_rules(words, patterns)
    for ident, raw in stored.items():
        record = parse_rule_record(ident, raw)
        if record is not None:
            records[ident] = record
    live = [r for r in records.values() if r.removed_unix_s is None]
    return Rules(
        words=tuple(r.value for r in live if r.kind == "word"),
        patterns=tuple(r.value for r in live if r.kind == "pattern"),
        records=records,
    )
