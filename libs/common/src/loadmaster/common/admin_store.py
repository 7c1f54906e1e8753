"""The admin plane in Redis: every Redis call it makes, and the watcher that keeps a process's
copy current (docs/admin.md).

Keys, under `redis.admin_key_prefix` (default `loadmaster:admin`):

    <prefix>:config       hash: runtime setting path (`scheduler.strategy`) -> JSON value
    <prefix>:keys         hash: API key name -> JSON record (its SHA-256, never the key)
    <prefix>:guardrails   hash: guardrail id -> JSON record
    <prefix>:version      counter: +1 with each change, whatever its kind
    <prefix>:changes      pub/sub channel: "<kind> <version>" after each change

Every change is one compare-and-set script (`LUA_COMPARE_AND_SET`): it writes only when the
field still holds the value the caller read, bumps the version and publishes, so two admins
changing one entry at once cannot lose either change silently, and a process that saw a
version has seen every change up to it.

`AdminWatcher` reads everything once, then again on each published change, and also checks
the version every `poll_s` (a message lost while the subscription was down costs at most that
long). When Redis cannot be reached it keeps the last state it read, warns once per outage,
and retries with backoff. Readers on the request path use the copy, never Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError

from loadmaster.common.config import Settings
from loadmaster.common.errors import FailedPreconditionError, UnavailableError
from loadmaster.common.redis_url import is_sentinel_url, parse_sentinel_url, redact_redis_url
from loadmaster.common.retry import Backoff
from loadmaster.common.runtime_config import differences, merge_stored

__all__ = [
    "ABSENT",
    "ANY",
    "KINDS",
    "LUA_COMPARE_AND_SET",
    "AdminState",
    "AdminStore",
    "AdminWatcher",
    "ConflictError",
    "Kind",
    "stored_settings",
    "watch_settings",
]

log = logging.getLogger(__name__)

Kind = Literal["config", "keys", "guardrails"]
KINDS: tuple[Kind, ...] = ("config", "keys", "guardrails")


class _Marker:
    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


ABSENT: Any = _Marker("ABSENT")  # no value (as `expected`: the field must not exist; as `new`: delete it)
ANY: Any = _Marker("ANY")  # as `expected`: whatever the field holds

# KEYS[1] the kind's hash, KEYS[2] the version counter
# ARGV[1] the field; ARGV[2] the value the caller read ('' = absent, '*' = whatever is there);
# ARGV[3] the new value ('' = delete the field); ARGV[4] the channel; ARGV[5] the kind
# Returns {1, previous value ('' when absent), new version} when written, or {0, current value
# ('' when absent)} when the field no longer holds what the caller read (nothing is written).
LUA_COMPARE_AND_SET = """
local current = redis.call('HGET', KEYS[1], ARGV[1]) or ''
if ARGV[2] ~= '*' and current ~= ARGV[2] then
  return {0, current}
end
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
end
local version = redis.call('INCR', KEYS[2])
redis.call('PUBLISH', ARGV[4], ARGV[5] .. ' ' .. version)
return {1, current, version}
"""


class ConflictError(FailedPreconditionError):
    """The entry changed between reading it and writing it (another admin's change won)."""

    http_status = 409


@dataclass(frozen=True, slots=True)
class AdminState:
    """Everything the admin plane holds, as of `version` (0: nothing was ever changed)."""

    version: int = 0
    config: Mapping[str, Any] = field(default_factory=dict)
    keys: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    guardrails: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


def _decode(kind: str, raw: Mapping[bytes | str, bytes | str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, text in raw.items():
        key = name.decode() if isinstance(name, bytes) else name
        try:
            out[key] = json.loads(text)
        except ValueError:
            log.warning("admin store: %s entry %r is not JSON; ignored", kind, key)
    return out


def encode(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


class AdminStore:
    """Reads and compare-and-set writes of the admin plane's keys (one Redis client)."""

    def __init__(self, client: aioredis.Redis, *, prefix: str, sentinel: Sentinel | None = None) -> None:
        self._redis = client
        self._sentinel = sentinel
        self.prefix = prefix
        self.channel = f"{prefix}:changes"
        self._version_key = f"{prefix}:version"
        self._cas = client.register_script(LUA_COMPARE_AND_SET)

    @classmethod
    def connect(cls, url: str, *, prefix: str, timeout_s: float = 2.0) -> AdminStore:
        """A store on `url` (redis:// or redis+sentinel://); each call gives up after `timeout_s`."""
        options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
        sentinel_options = dict(options)
        # A pooled connection that a Redis restart closed fails once: the call is made again on
        # a new one (a compare-and-set that did run then answers ConflictError, never twice).
        options["retry"] = Retry(ExponentialBackoff(cap=0.25, base=0.05), 2)
        if is_sentinel_url(url):
            target = parse_sentinel_url(url)
            sentinel = Sentinel(
                list(target.sentinels),
                sentinel_kwargs={**sentinel_options, "password": target.sentinel_password},
            )
            client = sentinel.master_for(
                target.service_name,
                db=target.db,
                username=target.username,
                password=target.password,
                **options,
            )
            return cls(client, prefix=prefix, sentinel=sentinel)
        return cls(aioredis.Redis.from_url(url, **options), prefix=prefix)

    def hash_key(self, kind: Kind) -> str:
        return f"{self.prefix}:{kind}"

    async def read(self) -> AdminState:
        """Everything, as one consistent snapshot (MULTI/EXEC)."""
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.get(self._version_key)
                for kind in KINDS:
                    pipe.hgetall(self.hash_key(kind))
                version, config, keys, guardrails = await pipe.execute()
        except (RedisError, OSError) as error:
            raise UnavailableError(f"the admin store (Redis) cannot be reached: {error}") from None
        return AdminState(
            version=int(version or 0),
            config=_decode("config", config),
            keys=_decode("keys", keys),
            guardrails=_decode("guardrails", guardrails),
        )

    async def version(self) -> int:
        try:
            return int(await self._redis.get(self._version_key) or 0)
        except (RedisError, OSError) as error:
            raise UnavailableError(f"the admin store (Redis) cannot be reached: {error}") from None

    async def compare_and_set(self, kind: Kind, name: str, *, expected: Any, new: Any) -> tuple[Any, int]:
        """Write `new` (`ABSENT`: delete) at `name` if it still holds `expected` (`ABSENT`: no
        value; `ANY`: whatever it holds); (the previous value or `ABSENT`, the new version).
        `ConflictError` when it holds something else. Values are compared as `encode` writes
        them, which is how every value here was written."""
        expected_text = "*" if expected is ANY else ("" if expected is ABSENT else encode(expected))
        try:
            reply = await self._cas(
                keys=[self.hash_key(kind), self._version_key],
                args=[name, expected_text, "" if new is ABSENT else encode(new), self.channel, kind],
            )
        except (RedisError, OSError) as error:
            raise UnavailableError(f"the admin store (Redis) cannot be reached: {error}") from None
        written, current = int(reply[0]), reply[1]
        if not written:
            raise ConflictError(f"{kind} '{name}' was changed by someone else meanwhile; read it again")
        text = current.decode() if isinstance(current, bytes) else str(current)
        return (json.loads(text) if text else ABSENT), int(reply[2])

    def pubsub(self) -> aioredis.client.PubSub:
        return self._redis.pubsub()

    async def close(self) -> None:
        await self._redis.aclose()
        if self._sentinel is not None:
            await self._sentinel.aclose()


class AdminWatcher:
    """Keeps `on_state` fed with the admin state: once at start, then after each change."""

    def __init__(
        self,
        store: AdminStore,
        on_state: Callable[[AdminState], Awaitable[None]],
        *,
        poll_s: float = 5.0,
        retry_s: tuple[float, float] = (0.25, 5.0),
        url: str = "",
        owns_store: bool = False,
    ) -> None:
        self._store = store
        self._owns_store = owns_store
        self._on_state = on_state
        self._poll_s = poll_s
        self._retry_s = retry_s
        self._where = redact_redis_url(url) if url else "Redis"
        self.state: AdminState | None = None  # the last state read (None before the first)
        self.connected = False
        self._loaded = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self, *, first_read_timeout_s: float = 2.0) -> bool:
        """Start watching; wait up to `first_read_timeout_s` for the first read (True if it came)."""
        self._task = asyncio.create_task(self._run(), name="admin-watcher")
        try:
            async with asyncio.timeout(first_read_timeout_s):
                await self._loaded.wait()
        except TimeoutError:
            log.warning(
                "admin plane: %s not reachable at start; serving on the configuration file's "
                "settings until it is",
                self._where,
            )
            return False
        return True

    async def _run(self) -> None:
        backoff = Backoff(first_s=self._retry_s[0], max_s=self._retry_s[1])
        down_since_warned = False
        while True:
            pubsub = self._store.pubsub()
            try:
                await pubsub.subscribe(self._store.channel)
                await self._refresh(force=True)  # after subscribing: no change falls in between
                if down_since_warned:
                    log.info("admin plane: %s reachable again; settings re-read", self._where)
                down_since_warned, self.connected = False, True
                backoff.reset()
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=self._poll_s)
                    if message is None:
                        if await self._store.version() != (self.state.version if self.state else -1):
                            await self._refresh()
                        continue
                    while await pubsub.get_message(ignore_subscribe_messages=True, timeout=0) is not None:
                        pass  # a burst of changes: one read covers them all
                    await self._refresh()
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, UnavailableError) as error:
                self.connected = False
                if not down_since_warned:
                    log.warning(
                        "admin plane: %s unreachable (%s); keeping the last settings read, retrying",
                        self._where,
                        error,
                    )
                    down_since_warned = True
            except Exception:
                self.connected = False
                log.exception("admin plane: watcher step failed; retrying")
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(backoff.next_s())

    async def _refresh(self, *, force: bool = False) -> None:
        state = await self._store.read()
        if force or self.state is None or state.version != self.state.version:
            try:
                await self._on_state(state)
            except Exception:
                log.exception(
                    "admin plane: applying version %d failed; the previous settings stay", state.version
                )
        self.state = state
        self._loaded.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._owns_store:
            await self._store.close()


def _laid_over(settings: Settings, state: AdminState, *, warn: tuple[str, ...]) -> Settings:
    """`settings` with the stored runtime values; a warning for each that differs from the
    file's among the paths starting with one of `warn`, an error for each that cannot apply."""
    merged, refused = merge_stored(settings, state.config)
    for path, why in refused.items():
        log.error("runtime setting %s: the stored value cannot be used (%s); the file's stays", path, why)
    for diff in differences(settings, state.config):
        if diff.path.startswith(warn):
            log.warning(
                "%s: the value set at run time (%r) wins over the configuration file's (%r); "
                "`loadmaster config reset %s` takes the file's again",
                diff.path,
                diff.stored,
                diff.configured,
                diff.path,
            )
    return merged


async def stored_settings(
    settings: Settings, *, warn: tuple[str, ...] = ("",), timeout_s: float = 2.0
) -> Settings:
    """`settings` with the runtime values stored in Redis laid over them (a service's start);
    the file's alone without `redis_url`, or when Redis does not answer (a warning says so)."""
    if not settings.redis_url:
        return settings
    store = AdminStore.connect(
        settings.redis_url, prefix=settings.redis.admin_key_prefix, timeout_s=timeout_s
    )
    try:
        state = await store.read()
    except UnavailableError as error:
        log.warning("runtime settings not read (%s); starting on the configuration file's", error.message)
        return settings
    finally:
        await store.close()
    return await asyncio.to_thread(_laid_over, settings, state, warn=warn)


def watch_settings(
    settings: Settings,
    apply: Callable[[Settings], None],
    *,
    warn: tuple[str, ...] = ("",),
    poll_s: float = 5.0,
) -> AdminWatcher | None:
    """A watcher (not started) that calls `apply` with `settings` and the stored runtime values
    laid over them, at start and after each change; None without `redis_url`."""
    if not settings.redis_url:
        return None
    store = AdminStore.connect(settings.redis_url, prefix=settings.redis.admin_key_prefix)
    first = True

    async def on_state(state: AdminState) -> None:
        nonlocal first
        merged = await asyncio.to_thread(_laid_over, settings, state, warn=warn if first else ())
        first = False
        apply(merged)

    return AdminWatcher(store, on_state, poll_s=poll_s, url=settings.redis_url, owns_store=True)
