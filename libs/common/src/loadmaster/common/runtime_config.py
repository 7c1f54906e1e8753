"""Settings that may change while the suite runs: which ones, and laying stored values over the
YAML's (pure: the Redis side is `loadmaster.common.admin_store`; docs/admin.md).

A runtime setting is named by its dotted path in `Settings` (`scheduler.strategy`,
`models.known.tiny-chat.pin`). `RUNTIME_PATHS` lists the paths that may be set, with `*` for
one key of a mapping (a model, an alias, a tenant); the key may itself hold dots
(`models.known.llama-3.1-8b.pin`). A value is checked by the pydantic model of the whole
`Settings` after it is laid over the current ones, so a runtime value is refused for exactly
the reasons a YAML value would be. To let another setting change at run time, add its path
here (and apply it where it is read: docs/admin.md says where).

Setting a whole mapping entry (a path ending in `*`) to null removes the entry.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import to_jsonable_python

from loadmaster.common.errors import InvalidArgumentError

__all__ = [
    "RUNTIME_PATHS",
    "Difference",
    "RuntimePath",
    "apply_overrides",
    "differences",
    "effective_values",
    "merge_stored",
    "resolve",
    "value_at",
]

RUNTIME_PATHS: tuple[str, ...] = (
    "scheduler.strategy",
    "scheduler.policy",
    "models.known.*.pin",
    "models.known.*.keep_alive_s",
    "models.aliases.*",
    "models.allow_cloud_fallback",
    "tenants.*",
    "tenants.*.weight",
    "gateway.auth.required",
    "clients.profiles.*",
    "clients.cooldown",
)

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class RuntimePath:
    """A path that may be set: its parts (the mapping key as one part) and the pattern it matched."""

    path: str
    parts: tuple[str, ...]
    pattern: str

    @property
    def removable(self) -> bool:
        """Null removes the entry (the path names a whole mapping entry)."""
        return self.pattern.endswith("*")


def resolve(path: str, patterns: Iterable[str] = RUNTIME_PATHS) -> RuntimePath:
    """`path` as a `RuntimePath`, or `InvalidArgumentError` naming what may be set."""
    best: RuntimePath | None = None
    for pattern in patterns:
        head, star, tail = pattern.partition("*")
        if not star:
            if path == pattern:
                return RuntimePath(path, tuple(path.split(".")), pattern)
            continue
        if not (path.startswith(head) and path.endswith(tail) and len(path) > len(head) + len(tail)):
            continue
        key = path[len(head) : len(path) - len(tail)]
        if not key or key.startswith(".") or key.endswith("."):
            continue
        parts = (*head.rstrip(".").split("."), key, *(tail.lstrip(".").split(".") if tail else ()))
        found = RuntimePath(path, parts, pattern)
        if best is None or len(tail) > len(best.pattern.partition("*")[2]):  # most specific
            best = found
    if best is None:
        raise InvalidArgumentError(
            f"'{path}' cannot be set at run time; these can (* = a model, alias or tenant name): "
            + ", ".join(patterns)
        )
    return best


def value_at(settings: BaseModel, path: RuntimePath | str) -> Any:
    """The JSON value at `path` in `settings` (null for a mapping entry that is not there)."""
    parts = (resolve(path) if isinstance(path, str) else path).parts
    node: Any = settings
    for part in parts:
        if isinstance(node, BaseModel):
            node = getattr(node, part, None)
        elif isinstance(node, Mapping):
            node = node.get(part)
        else:
            node = None
        if node is None:
            return None
    return to_jsonable_python(node)


def effective_values(settings: BaseModel, patterns: Iterable[str] = RUNTIME_PATHS) -> dict[str, Any]:
    """Every runtime path with a value in `settings`: wildcards expanded over the mapping's keys."""
    out: dict[str, Any] = {}
    for pattern in patterns:
        head, star, tail = pattern.partition("*")
        if not star:
            out[pattern] = value_at(settings, pattern)
            continue
        mapping: Any = settings
        for part in head.rstrip(".").split("."):
            mapping = getattr(mapping, part)
        for key in sorted(mapping):
            path = f"{head}{key}{tail}"
            out[path] = value_at(settings, resolve(path, patterns))
    return dict(sorted(out.items()))


def apply_overrides(
    settings: M, overrides: Mapping[str, Any], *, patterns: Iterable[str] = RUNTIME_PATHS
) -> M:
    """`settings` with each `{path: value}` laid over it, checked by its pydantic model as a
    whole; `InvalidArgumentError` names each path a value is refused for."""
    patterns = tuple(patterns)
    if not overrides:
        return settings
    # Only what was set (YAML, environment, overrides) goes round: a field left at its
    # default stays unset, so merges such as `models.for_model` keep working.
    data = settings.model_dump(exclude_unset=True)
    for path, value in overrides.items():
        target = resolve(path, patterns)
        _put(data, target, value)
    try:
        return type(settings).model_validate(data)
    except ValidationError as error:
        raise InvalidArgumentError(describe(error)) from None


def _put(data: dict[str, Any], target: RuntimePath, value: Any) -> None:
    node = data
    for part in target.parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    last = target.parts[-1]
    if value is None and target.removable:
        node.pop(last, None)
    else:
        node[last] = value


def describe(error: ValidationError) -> str:
    """One line per refused value: `tenants.a.weight: Input should be greater than 0 (got -1)`."""
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        got = "" if item["type"] in ("missing", "value_error") else f" (got {item.get('input')!r})"
        if item["type"] == "extra_forbidden":
            got = " (unknown key)"
        lines.append(f"{where}: {message}{got}" if where else message)
    return "; ".join(lines)


@dataclass(frozen=True, slots=True)
class Difference:
    path: str
    configured: Any  # what the YAML (or the environment) says
    stored: Any  # what was set at run time, and wins


def differences(base: BaseModel, stored: Mapping[str, Any]) -> list[Difference]:
    """Stored values that differ from the configured ones (each is named in a warning at start)."""
    out = []
    for path, value in sorted(stored.items()):
        try:
            configured = value_at(base, path)
        except InvalidArgumentError:
            continue  # no longer settable: merge_stored reports it
        if _canonical(configured) != _canonical(value):
            out.append(Difference(path, configured, value))
    return out


def merge_stored(
    base: M, stored: Mapping[str, Any], *, patterns: Iterable[str] = RUNTIME_PATHS
) -> tuple[M, dict[str, str]]:
    """`base` with every stored value that can still be applied, and `{path: why}` for those
    that cannot (a path no longer settable, or a value the current config refuses, such as an
    alias of a model that left the repository): one bad value never hides the others."""
    patterns = tuple(patterns)
    try:
        return apply_overrides(base, stored, patterns=patterns), {}
    except InvalidArgumentError:
        pass
    merged, refused = base, {}
    for path, value in sorted(stored.items()):
        try:
            merged = apply_overrides(merged, {path: value}, patterns=patterns)
        except InvalidArgumentError as error:
            refused[path] = error.message
    return merged, refused


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)
