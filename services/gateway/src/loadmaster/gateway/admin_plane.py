"""The admin plane in the gateway: API keys, guardrail rules and runtime settings changed while
the suite runs, kept in Redis, applied here and on every other gateway (docs/admin.md).

What a request reads lives in memory: the `Authenticator`'s key table, the `Guardrails`'
blocklist, the ladders of the `GenerationRouter` and `settings` (the YAML's settings with the
stored runtime values laid over them). `AdminWatcher` brings each change (Redis pub/sub) and
`_apply` rebuilds these off the event loop and swaps them in at once, so the request path
never waits on Redis and never sees half a change. With Redis down the gateway keeps the
last state it read.

Each operation reads the current state, checks the change with the pydantic models of the
configuration, writes it with one compare-and-set (a concurrent change to the same entry is
refused with 409 rather than lost), writes an audit record with who made it and the values
before and after, and applies the result here before it answers (other gateways follow
within the pub/sub delivery time). Without `redis_url` the plane only reads: the YAML's keys,
rules and settings.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from loadmaster.common.admin_store import ABSENT, AdminState, AdminStore, AdminWatcher, ConflictError, Kind
from loadmaster.common.config import Settings
from loadmaster.common.errors import InvalidArgumentError, NotFoundError, UnavailableError
from loadmaster.common.gateway_config import ApiKeySettings
from loadmaster.common.ordering import STRATEGIES
from loadmaster.common.runtime_config import (
    apply_overrides,
    describe,
    differences,
    effective_values,
    merge_stored,
    resolve,
    value_at,
)
from loadmaster.gateway.admin import SchedulerAdmin
from loadmaster.gateway.audit import AdminRecord, AuditLog
from loadmaster.gateway.auth import Authenticator, KeyTable, Principal, new_api_key
from loadmaster.gateway.generations import GenerationRouter
from loadmaster.gateway.guardrails import Blocklist, Guardrails
from loadmaster.gateway.keyring import (
    GraceKey,
    GuardrailRecord,
    KeyRecord,
    Rules,
    effective_keys,
    effective_rules,
    key_view,
    rule_id,
    stored_differs,
)
from loadmaster.gateway.ladders import ladders_from

__all__ = ["KEY_NAME", "AdminPlane", "RuntimeView"]

log = logging.getLogger(__name__)

KEY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
STRATEGY_PATHS = ("scheduler.strategy", "scheduler.policy")
DEFAULT_GRACE_S = 3600.0


@dataclass(frozen=True, slots=True)
class RuntimeView:
    """What this gateway serves by, as of admin state `version`."""

    version: int
    settings: Settings
    keys: Sequence[ApiKeySettings]
    key_table: KeyTable
    key_records: Mapping[str, KeyRecord]
    rules: Rules
    blocklist: Blocklist
    state: AdminState = field(default_factory=AdminState)  # what the store held (writes compare to it)


class AdminPlane:
    def __init__(
        self,
        settings: Settings,
        *,
        auth: Authenticator,
        guardrails: Guardrails,
        generations: GenerationRouter,
        scheduler: SchedulerAdmin,
        audit: AuditLog | None,
        gateway_id: str,
        store: AdminStore | None = None,
        poll_s: float = 5.0,
    ) -> None:
        self._base = settings
        self._auth = auth
        self._guardrails = guardrails
        self._generations = generations
        self._scheduler = scheduler
        self._audit = audit
        self._gateway_id = gateway_id
        self._store = store
        self._watcher = (
            AdminWatcher(store, self._apply, poll_s=poll_s, url=settings.redis_url or "")
            if store is not None
            else None
        )
        self._warned = False
        self.view = self._build(AdminState())

    @classmethod
    def connect_store(cls, settings: Settings) -> AdminStore | None:
        if not settings.redis_url:
            return None
        return AdminStore.connect(settings.redis_url, prefix=settings.redis.admin_key_prefix)

    # ---- what requests read --------------------------------------------------------------

    @property
    def settings(self) -> Settings:
        """The settings in force: the YAML's, with the runtime values laid over them."""
        return self.view.settings

    def tenant_weight(self, tenant: str) -> float:
        entry = self.view.settings.tenants.get(tenant)
        return entry.weight if entry is not None else 1.0

    @property
    def connected(self) -> bool:
        return self._watcher is not None and self._watcher.connected

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self, *, first_read_timeout_s: float = 2.0) -> None:
        """Apply what is stored before the gateway serves (a revoked key must not pass for the
        first milliseconds); without Redis at start, the YAML's until it comes."""
        self._install(self.view)
        if self._watcher is not None and await self._watcher.start(first_read_timeout_s=first_read_timeout_s):
            self._warned = True  # the file and the store were compared on the state read at start

    async def close(self) -> None:
        if self._watcher is not None:
            await self._watcher.close()
        if self._store is not None:
            await self._store.close()

    async def reload(self) -> None:
        """Read the store and apply it now (after this gateway's own change)."""
        if self._store is not None:
            await self._apply(await self._store.read())

    async def _apply(self, state: AdminState) -> None:
        view = await asyncio.to_thread(self._build, state)  # validation and regexes: off the loop
        self._install(view)

    def _build(self, state: AdminState) -> RuntimeView:
        base = self._base
        merged, refused = merge_stored(base, state.config)
        for path, why in refused.items():
            log.error("admin plane: the stored value of %s cannot be used (%s); the file's stays", path, why)
        keys, records = effective_keys(base.gateway.auth.api_keys, state.keys, now_unix_s=time.time())
        guardrails = base.gateway.guardrails
        rules = effective_rules(guardrails.blocked_words, guardrails.blocked_patterns, state.guardrails)
        return RuntimeView(
            version=state.version,
            settings=merged,
            keys=keys,
            key_table=self._auth.prepare_keys(keys),
            key_records=records,
            rules=rules,
            blocklist=Blocklist(rules.words, rules.patterns),
            state=state,
        )

    def _install(self, view: RuntimeView) -> None:
        if view.version < self.view.version:
            return  # a slower rebuild of an older state
        if view.version > 0 and not self._warned:
            self._warned = True
            self._warn_overrides(view)
        self._auth.use_keys(view.key_table, required=view.settings.gateway.auth.keys_required)
        self._guardrails.use_blocklist(view.blocklist)
        self._generations.set_ladders(ladders_from(view.settings.models.aliases))
        changed = view.version != self.view.version
        self.view = view
        if changed:
            log.info("admin plane: serving admin state version %d", view.version)

    def _warn_overrides(self, view: RuntimeView) -> None:
        """At the first state read: name each stored value that differs from the file's."""
        for diff in differences(self._base, view.state.config):
            log.warning(
                "%s: the value set at run time (%s) wins over the configuration file's (%s); "
                "`loadmaster config reset %s` takes the file's again",
                diff.path,
                _short(diff.stored),
                _short(diff.configured),
                diff.path,
            )
        for key in self._base.gateway.auth.api_keys:
            record = view.key_records.get(key.name)
            if record is not None and stored_differs(key, record):
                what = "revoked" if record.revoked else "changed"
                log.warning(
                    "gateway.auth.api_keys '%s': the key was %s at run time; that wins over the "
                    "configuration file's entry",
                    key.name,
                    what,
                )
        for record in view.rules.records.values():
            if record.source == "config" and record.removed_unix_s is not None:
                log.warning(
                    "gateway.guardrails: the %s rule %s was removed at run time; that wins over "
                    "the configuration file",
                    record.kind,
                    record.id,
                )

    # ---- writes --------------------------------------------------------------------------

    def _writable(self) -> AdminStore:
        if self._store is None:
            raise UnavailableError("changes at run time need Redis (redis_url); this gateway has none")
        return self._store

    async def _write(self, kind: Kind, name: str, *, expected: Any, new: Any) -> Any:
        previous, _ = await self._writable().compare_and_set(kind, name, expected=expected, new=new)
        return previous

    def _audit_change(
        self,
        who: Principal,
        action: str,
        target: str,
        *,
        old: Any = None,
        new: Any = None,
        error: Exception | None = None,
    ) -> None:
        if self._audit is None:
            return
        outcome = "ok" if error is None else getattr(error, "edge_code", "internal")
        self._audit.write(
            AdminRecord(
                time_unix_s=time.time(),
                action=action,
                target=target,
                outcome=outcome,
                subject=who.name,
                auth=who.method,
                old=old,
                new=new,
                error="" if error is None else getattr(error, "message", str(error)),
                gateway_id=self._gateway_id,
            )
        )

    def refused(self, who: Principal, action: str, target: str, error: Exception) -> None:
        """Audit an attempt that was refused before it reached the plane (auth, a bad body)."""
        self._audit_change(who, action, target, error=error)

    # ---- keys ----------------------------------------------------------------------------

    def list_keys(self) -> list[dict[str, Any]]:
        now = time.time()
        return [key_view(r, now_unix_s=now) for _, r in sorted(self.view.key_records.items())]

    async def add_key(
        self,
        who: Principal,
        name: str,
        *,
        scopes: Sequence[str] = ("infer",),
        rate_per_s: float = 0.0,
        burst: int = 0,
        tenant: str = "",
        expires_unix_s: float | None = None,
        weight: float | None = None,
    ) -> dict[str, Any]:
        """A new key: its record is stored (its hash); the key itself is returned, once."""
        try:
            if not KEY_NAME.match(name):
                raise InvalidArgumentError(
                    "name: 1-64 characters, letters, digits, '.', '_' or '-', starting with a letter or digit"
                )
            await self.reload()
            existing = self.view.key_records.get(name)
            if existing is not None and not existing.revoked:
                raise ConflictError(
                    f"key '{name}' exists; `keys update {name} --rotate` issues a new key for it"
                )
            key = new_api_key()
            now = time.time()
            record = _valid_key(
                name=name,
                sha256=_sha256(key),
                scopes=list(scopes),
                rate_per_s=rate_per_s,
                burst=burst,
                tenant=tenant,
                expires_unix_s=expires_unix_s,
                created_unix_s=now,
                updated_unix_s=now,
            )
            if weight is not None:
                await self.set_config(who, {f"tenants.{tenant or name}.weight": weight})
            await self._write(
                "keys", name, expected=self._stored_key(name), new=record.model_dump(mode="json")
            )
        except Exception as error:
            self._audit_change(who, "keys.add", name, error=error)
            raise
        new_view = key_view(record, now_unix_s=now)
        self._audit_change(who, "keys.add", name, old=_view_or_none(existing), new=new_view)
        await self.reload()
        return {**new_view, "key": key}

    async def update_key(
        self,
        who: Principal,
        name: str,
        changes: Mapping[str, Any],
        *,
        rotate: bool = False,
        grace_s: float = DEFAULT_GRACE_S,
        weight: float | None = None,
    ) -> dict[str, Any]:
        """Change a key's scopes, limits, tenant or expiry; with `rotate`, issue a new key and
        keep the old one valid for `grace_s`."""
        try:
            unknown = sorted(set(changes) - {"scopes", "rate_per_s", "burst", "tenant", "expires_unix_s"})
            if unknown:
                raise InvalidArgumentError(f"{unknown[0]}: not a field a key update can change")
            if grace_s < 0:
                raise InvalidArgumentError("grace_s: must be at least 0")
            await self.reload()
            current = self._live_key(name)
            now = time.time()
            update: dict[str, Any] = {**changes, "updated_unix_s": now}
            key = ""
            if rotate:
                key = new_api_key()
                graces = [g for g in current.grace if g.until_unix_s > now]
                if grace_s > 0:
                    graces.append(GraceKey(sha256=current.sha256, until_unix_s=now + grace_s))
                update |= {"sha256": _sha256(key), "grace": [g.model_dump() for g in graces]}
            record = _valid_key(**{**current.model_dump(), **update})
            if weight is not None:
                await self.set_config(who, {f"tenants.{record.tenant or name}.weight": weight})
            await self._write(
                "keys", name, expected=self._stored_key(name), new=record.model_dump(mode="json")
            )
        except Exception as error:
            self._audit_change(who, "keys.update", name, error=error)
            raise
        old_view, new_view = key_view(current, now_unix_s=now), key_view(record, now_unix_s=now)
        self._audit_change(who, "keys.rotate" if rotate else "keys.update", name, old=old_view, new=new_view)
        await self.reload()
        return {**new_view, "key": key} if rotate else new_view

    async def revoke_key(self, who: Principal, name: str) -> dict[str, Any]:
        """Refuse the key (and any rotated-out key of its name) from now on, on every gateway."""
        try:
            await self.reload()
            current = self._live_key(name)
            now = time.time()
            record = current.model_copy(update={"revoked_unix_s": now, "updated_unix_s": now, "grace": []})
            await self._write(
                "keys", name, expected=self._stored_key(name), new=record.model_dump(mode="json")
            )
        except Exception as error:
            self._audit_change(who, "keys.revoke", name, error=error)
            raise
        old_view, new_view = key_view(current, now_unix_s=now), key_view(record, now_unix_s=now)
        self._audit_change(who, "keys.revoke", name, old=old_view, new=new_view)
        await self.reload()
        return new_view

    def _live_key(self, name: str) -> KeyRecord:
        record = self.view.key_records.get(name)
        if record is None or record.revoked:
            raise NotFoundError(
                f"no key named '{name}'" + (" (it was revoked)" if record is not None else "")
            )
        return record

    def _stored_key(self, name: str) -> Any:
        return self.view.state.keys.get(name, ABSENT)

    # ---- guardrails ----------------------------------------------------------------------

    def list_guardrails(self) -> list[dict[str, Any]]:
        return [
            _rule_view(r)
            for r in sorted(self.view.rules.records.values(), key=lambda r: (r.kind, r.value))
            if r.removed_unix_s is None
        ]

    async def add_guardrail(self, who: Principal, kind: str, value: str) -> dict[str, Any]:
        ident = rule_id(kind, value)
        try:
            if kind not in ("word", "pattern"):
                raise InvalidArgumentError("kind: 'word' or 'pattern'")
            record = _valid_rule(
                id=ident, kind=kind, value=value, created_unix_s=time.time(), created_by=who.name
            )
            await self.reload()
            existing = self.view.rules.records.get(ident)
            if existing is not None and existing.removed_unix_s is None:
                raise ConflictError(f"that {kind} is already blocked (guardrail {ident})")
            await self._write(
                "guardrails",
                ident,
                expected=self.view.state.guardrails.get(ident, ABSENT),
                new=record.model_dump(),
            )
        except Exception as error:
            self._audit_change(who, "guardrails.add", ident, error=error)
            raise
        self._audit_change(who, "guardrails.add", ident, new=_rule_view(record))
        await self.reload()
        return _rule_view(record)

    async def remove_guardrail(self, who: Principal, ident: str) -> dict[str, Any]:
        try:
            await self.reload()
            record = self.view.rules.records.get(ident)
            if record is None or record.removed_unix_s is not None:
                raise NotFoundError(f"no guardrail '{ident}' (`guardrails list` shows their ids)")
            removed = record.model_copy(update={"removed_unix_s": time.time()})
            await self._write(
                "guardrails",
                ident,
                expected=self.view.state.guardrails.get(ident, ABSENT),
                new=removed.model_dump(),
            )
        except Exception as error:
            self._audit_change(who, "guardrails.remove", ident, error=error)
            raise
        self._audit_change(who, "guardrails.remove", ident, old=_rule_view(record))
        await self.reload()
        return _rule_view(removed)

    # ---- runtime settings ----------------------------------------------------------------

    def get_config(self, path: str | None = None) -> dict[str, Any]:
        view = self.view
        if path is None:
            return {
                "version": view.version,
                "values": effective_values(view.settings),
                "stored": dict(sorted(view.state.config.items())),
            }
        target = resolve(path)
        return {
            "key": path,
            "value": value_at(view.settings, target),
            "configured": value_at(self._base, target),
            "stored": path in view.state.config,
        }

    async def set_config(self, who: Principal, values: Mapping[str, Any]) -> dict[str, Any]:
        """Set runtime settings (`{path: value}`), checked together; a strategy change is made
        on the scheduler first (it refuses an unknown policy), then stored."""
        return await self._change_config(
            who, "config.set", {path: (True, value) for path, value in values.items()}
        )

    async def reset_config(self, who: Principal, paths: Sequence[str]) -> dict[str, Any]:
        """Drop the stored values of `paths`: the configuration file's apply again."""
        return await self._change_config(who, "config.reset", {path: (False, None) for path in paths})

    async def _change_config(
        self, who: Principal, action: str, changes: Mapping[str, tuple[bool, Any]]
    ) -> dict[str, Any]:
        target = ",".join(changes)
        try:
            if not changes:
                raise InvalidArgumentError("name at least one setting")
            for path in changes:
                resolve(path)
            if self._store is not None:
                await self.reload()
            stored = dict(self.view.state.config)
            for path, (keep, value) in changes.items():
                if keep:
                    stored[path] = value
                else:
                    stored.pop(path, None)
            merged = apply_overrides(self._base, stored)  # InvalidArgumentError names the path
            before = {path: value_at(self.settings, path) for path in changes}
            strategy = await self._apply_strategy(changes, merged)
            persisted = self._store is not None
            if persisted:
                for path, (keep, value) in changes.items():
                    await self._write(
                        "config",
                        path,
                        expected=self.view.state.config.get(path, ABSENT),
                        new=value if keep else ABSENT,
                    )
            elif strategy is None:
                self._writable()  # raises: nothing else can change without Redis
        except Exception as error:
            self._audit_change(who, action, target, error=error)
            raise
        after = {path: value_at(merged, path) for path in changes}
        for path in changes:
            self._audit_change(who, action, path, old=before[path], new=after[path])
        await self.reload()
        reply: dict[str, Any] = {"values": after, "previous": before, "persisted": persisted}
        if strategy is not None:
            reply["scheduler"] = strategy
        return reply

    async def _apply_strategy(self, changes: Mapping[str, Any], merged: Settings) -> dict[str, Any] | None:
        if not any(path in STRATEGY_PATHS for path in changes):
            return None
        name, policy = merged.scheduler.strategy, merged.scheduler.policy or ""
        if name not in STRATEGIES:
            raise InvalidArgumentError(
                f"scheduler.strategy: unknown strategy '{name}'; known: {', '.join(STRATEGIES)}"
            )
        return await self._scheduler.set_strategy(name, policy)


def _sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _valid_key(**fields: Any) -> KeyRecord:
    try:
        return KeyRecord.model_validate(fields)
    except ValidationError as error:
        raise InvalidArgumentError(describe(error)) from None


def _valid_rule(**fields: Any) -> GuardrailRecord:
    try:
        return GuardrailRecord.model_validate(fields).check()
    except ValidationError as error:
        raise InvalidArgumentError(describe(error)) from None
    except ValueError as error:
        raise InvalidArgumentError(str(error)) from None


def _rule_view(record: GuardrailRecord) -> dict[str, Any]:
    return record.model_dump(exclude={"removed_unix_s"}) | {"removed": record.removed_unix_s is not None}


def _view_or_none(record: KeyRecord | None) -> dict[str, Any] | None:
    return None if record is None else key_view(record, now_unix_s=time.time())


def _short(value: Any) -> str:
    if value is None:
        return "not set"
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."
