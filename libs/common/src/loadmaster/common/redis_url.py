"""Redis URLs, parsed in one place: `redis+sentinel://` for a Redis behind Sentinel.

A Redis URL is either one that redis-py's `from_url` takes (`redis://`, `rediss://`,
`unix://`: one server) or a Sentinel URL:

    redis+sentinel://[[username]:password@]host:port[,host:port...]/service_name[/db][?sentinel_password=...]

The hosts are the Sentinels (at least one; port 26379 when left out); `service_name` is the
name they monitor the master under (`sentinel monitor <service_name> ...`); `db` defaults to
0. The password (and username) is the data nodes' (the master's and its replicas'); the
Sentinels are asked without one unless `sentinel_password` is given. Clients resolve the
current master through the Sentinels (redis-py's `Sentinel.master_for`) and resolve it again
after a failover. This module only parses: it imports no Redis client.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

from loadmaster.common.errors import InvalidArgumentError

__all__ = [
    "DEFAULT_SENTINEL_PORT",
    "SENTINEL_SCHEME",
    "RedisUrlError",
    "SentinelUrl",
    "is_sentinel_url",
    "parse_sentinel_url",
    "redact_redis_url",
]

SENTINEL_SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379
_PLAIN_SCHEMES = ("redis", "rediss", "unix")
_QUERY_KEYS = ("sentinel_password",)


class RedisUrlError(InvalidArgumentError, ValueError):
    """A malformed Redis URL; the message names the part at fault (never the password).
    A ValueError too, so a settings validator reports it against the field."""


@dataclass(frozen=True, slots=True)
class SentinelUrl:
    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None

    def redacted(self) -> str:
        """The URL back, with each password replaced by `***`."""
        auth = ""
        if self.password is not None or self.username:
            auth = f"{self.username or ''}:{'***' if self.password is not None else ''}@"
        hosts = ",".join(f"{_host_text(host)}:{port}" for host, port in self.sentinels)
        query = "?sentinel_password=***" if self.sentinel_password is not None else ""
        return f"{SENTINEL_SCHEME}://{auth}{hosts}/{self.service_name}/{self.db}{query}"


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() == SENTINEL_SCHEME


def parse_sentinel_url(url: str) -> SentinelUrl:
    """Parse a `redis+sentinel://` URL; raises `RedisUrlError` naming the malformed part."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != SENTINEL_SCHEME:
        raise RedisUrlError(
            f"Redis URL scheme: expected {SENTINEL_SCHEME}://, got {scheme + sep if sep else 'none'}"
        )
    try:
        parts = urlsplit(f"{SENTINEL_SCHEME}://{rest}")
    except ValueError as error:
        raise RedisUrlError(f"Sentinel URL hosts: {error}") from None
    if parts.fragment:
        raise RedisUrlError("Sentinel URL: a fragment (#...) is not allowed")
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    username = password = None
    if at:
        user_text, colon, password_text = userinfo.partition(":")
        if colon:
            username, password = unquote(user_text) or None, unquote(password_text)
        else:  # `word@host`: as in redis-py's URLs, a lone word is the password
            password = unquote(user_text)
    sentinels = tuple(
        _sentinel_address(item, position) for position, item in enumerate(hostlist.split(","), 1)
    )
    path = [unquote(segment) for segment in parts.path.removesuffix("/").split("/")[1:]]
    if not path or not path[0]:
        raise RedisUrlError("Sentinel URL service name: missing (redis+sentinel://host:port/<service_name>)")
    if len(path) > 2:
        raise RedisUrlError(f"Sentinel URL path: expected /service_name[/db], got {parts.path!r}")
    db = 0
    if len(path) == 2:
        if not path[1].isdigit():
            raise RedisUrlError(f"Sentinel URL db: expected a number >= 0, got {path[1]!r}")
        db = int(path[1])
    query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=False)
    unknown = sorted(set(query) - set(_QUERY_KEYS))
    if unknown:
        raise RedisUrlError(
            f"Sentinel URL query: unknown parameter {unknown[0]!r} (known: {', '.join(_QUERY_KEYS)})"
        )
    sentinel_password = query["sentinel_password"][-1] if "sentinel_password" in query else None
    return SentinelUrl(
        sentinels=sentinels,
        service_name=path[0],
        db=db,
        username=username,
        password=password,
        sentinel_password=sentinel_password,
    )


def redact_redis_url(url: str) -> str:
    """Any Redis URL with its passwords replaced by `***` (for logs and status tables)."""
    if is_sentinel_url(url):
        try:
            return parse_sentinel_url(url).redacted()
        except RedisUrlError:
            return f"{SENTINEL_SCHEME}://(malformed)"
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{parts.username or ''}:***@{host}").geturl()


def _sentinel_address(item: str, position: int) -> tuple[str, int]:
    text = item.strip()
    if not text:
        raise RedisUrlError(f"Sentinel URL host {position}: empty (hosts are host:port, comma-separated)")
    if text.startswith("["):  # [IPv6]:port
        host, bracket, port_text = text[1:].partition("]")
        if not bracket or (port_text and not port_text.startswith(":")):
            raise RedisUrlError(f"Sentinel URL host {position}: malformed IPv6 address {text!r}")
        port_text = port_text[1:]
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise RedisUrlError(f"Sentinel URL host {position}: missing host name in {text!r}")
    if not port_text:
        return host, DEFAULT_SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise RedisUrlError(f"Sentinel URL host {position} port: expected 1-65535, got {port_text!r}")
    return host, int(port_text)


def _host_text(host: str) -> str:
    return f"[{host}]" if ":" in host else host
