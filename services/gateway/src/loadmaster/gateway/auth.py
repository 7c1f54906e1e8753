"""API keys: hashed lookup, scopes and a per-key token bucket (pure; the clock is injected).

Keys are configured by their SHA-256 only (API keys are long random strings,
so a plain hash is enough; the key itself is never stored nor logged). An
`Authenticator` with no keys lets every call through (open mode, for
loopback). Errors name the problem, never the key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.config import ApiKeySettings
from loadmaster.common.errors import PermissionDeniedError, ResourceExhaustedError, UnauthenticatedError

__all__ = ["ADMIN", "INFER", "Authenticator", "TokenBucket", "bearer_token", "hash_key", "new_api_key"]

INFER = "infer"
ADMIN = "admin"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_api_key() -> str:
    return "lm_" + secrets.token_urlsafe(32)


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` value (None when absent or another scheme)."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


@dataclass(slots=True)
class TokenBucket:
    rate_per_s: float
    capacity: float
    tokens: float
    updated: float

    def take(self, now: float) -> bool:
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate_per_s)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


@dataclass(slots=True)
class _Key:
    name: str
    digest: bytes
    scopes: frozenset[str]
    bucket: TokenBucket | None = field(default=None)


class Authenticator:
    def __init__(self, keys: Sequence[ApiKeySettings], *, clock: Clock | None = None) -> None:
        self._clock = clock or SystemClock()
        now = self._clock.monotonic()
        self._keys: dict[bytes, _Key] = {}
        for key in keys:
            bucket = None
            if key.rate_per_s > 0:
                capacity = float(key.burst or max(1.0, key.rate_per_s))
                bucket = TokenBucket(key.rate_per_s, capacity, capacity, now)
            digest = bytes.fromhex(key.sha256)
            self._keys[digest] = _Key(key.name, digest, frozenset(key.scopes), bucket)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authorize(self, token: str | None, scope: str, *, charge: bool = True) -> str:
        """The key's name if `token` may make a call needing `scope`; else the matching error.

        Each call takes one token from the key's rate-limit bucket, unless `charge` is False
        (a stream's opening: each of its messages is charged as it arrives)."""
        if not self._keys:
            return ""
        if not token:
            raise UnauthenticatedError("an API key is required (Authorization: Bearer <key>)")
        digest = hashlib.sha256(token.encode()).digest()
        key = self._keys.get(digest)
        if key is None or not hmac.compare_digest(key.digest, digest):
            raise UnauthenticatedError("the API key is not valid")
        if scope not in key.scopes:
            raise PermissionDeniedError(f"API key '{key.name}' lacks the '{scope}' scope")
        if charge and key.bucket is not None and not key.bucket.take(self._clock.monotonic()):
            raise ResourceExhaustedError(
                f"API key '{key.name}' exceeded its rate limit of {key.bucket.rate_per_s:g} requests/s"
            )
        return key.name
