"""API keys: hashed lookup, scopes and a per-key token bucket (pure; the clock is injected).

Keys are configured by their SHA-256 only (API keys are long random strings,
so a plain hash is enough; the key itself is never stored nor logged). An
`Authenticator` that does not require keys lets every call through (open mode, for
loopback). Errors name the problem, never the key.

With an `OidcVerifier`, a bearer token that is a JWT is verified by it instead
(`authenticate`, async: the issuer's key set may have to be fetched); its scopes
come from the token, and each subject has a token bucket of its own.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.errors import PermissionDeniedError, ResourceExhaustedError, UnauthenticatedError
from loadmaster.common.gateway_config import ApiKeySettings, OidcSettings
from loadmaster.gateway.oidc import OidcVerifier, looks_like_jwt

__all__ = [
    "ADMIN",
    "INFER",
    "SUITE_ADMIN",
    "Authenticator",
    "KeyTable",
    "Principal",
    "TokenBucket",
    "bearer_token",
    "hash_key",
    "new_api_key",
]

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

    def refused(self, message: str) -> ResourceExhaustedError:
        """The rate-limit error, saying when the next token comes (`Retry-After`)."""
        error = ResourceExhaustedError(message)
        error.retry_after_s = max(0.0, (1.0 - self.tokens) / self.rate_per_s)
        return error


@dataclass(frozen=True, slots=True)
class Principal:
    """Who made a call: an API key's name, a token's subject, the suite's admin credential, or
    nobody (open mode).

    `tenant` is whose generations these are for token fairness: the key's `tenant` (else its
    name) or the token's subject; empty in open mode (the request then names one)."""

    name: str
    method: Literal["none", "api_key", "oidc", "admin_token"]
    tenant: str = ""


SUITE_ADMIN = Principal("suite-admin", "admin_token")


@dataclass(slots=True)
class _Key:
    name: str
    digest: bytes
    scopes: frozenset[str]
    tenant: str
    expires_unix_s: float | None
    bucket: TokenBucket | None = field(default=None)


@dataclass(frozen=True, slots=True)
class KeyTable:
    keys: dict[bytes, _Key]
    buckets: dict[str, TokenBucket | None]


def _bucket_for(key: ApiKeySettings, old: TokenBucket | None, now: float) -> TokenBucket | None:
    """A key's token bucket: `old` while the limits stay the same, else a full new one."""
    if key.rate_per_s <= 0:
        return None
    capacity = float(key.burst or max(1.0, key.rate_per_s))
    if old is not None and old.rate_per_s == key.rate_per_s and old.capacity == capacity:
        return old
    return TokenBucket(key.rate_per_s, capacity, capacity, now)


class Authenticator:
    """Checks bearer tokens against API keys (by their SHA-256), OIDC tokens and, for the
    `admin` scope, the suite's admin credential.

    Calls need a credential when `required` (None: exactly when `keys` lists any), or when OIDC
    is on; otherwise every call passes as nobody (open mode, for loopback). `replace_keys`
    swaps the key table at once (the admin plane calls it on each change; docs/admin.md): a
    key's rate-limit bucket is kept while its limits stay the same."""

    def __init__(
        self,
        keys: Sequence[ApiKeySettings],
        *,
        required: bool | None = None,
        clock: Clock | None = None,
        oidc: OidcVerifier | None = None,
        oidc_settings: OidcSettings | None = None,
        admin_token: Callable[[str], bool] | None = None,
    ) -> None:
        self._clock = clock or SystemClock()
        self._oidc = oidc
        self._oidc_settings = oidc_settings or OidcSettings()
        self._is_admin_token = admin_token
        self._subjects: OrderedDict[str, TokenBucket] = OrderedDict()  # least recently used first
        self._keys: dict[bytes, _Key] = {}
        self._buckets: dict[str, TokenBucket | None] = {}
        self._required = bool(keys) if required is None else required
        self.replace_keys(keys, required=self._required)

    def replace_keys(self, keys: Sequence[ApiKeySettings], *, required: bool) -> None:
        """Serve `keys` from now on (several digests may share a name: a rotated key's grace)."""
        self.use_keys(self.prepare_keys(keys), required=required)

    def prepare_keys(self, keys: Sequence[ApiKeySettings]) -> KeyTable:
        """The table `use_keys` swaps in; its cost grows with the keys, so the admin plane makes
        it on a thread (it only reads the current buckets, to keep those of unchanged keys)."""
        now = self._clock.monotonic()
        current = dict(self._buckets)
        buckets: dict[str, TokenBucket | None] = {}
        table: dict[bytes, _Key] = {}
        for key in keys:
            if key.name not in buckets:
                buckets[key.name] = _bucket_for(key, current.get(key.name), now)
            digest = bytes.fromhex(key.sha256)
            table[digest] = _Key(
                key.name,
                digest,
                frozenset(key.scopes),
                key.tenant or key.name,
                key.expires_unix_s,
                buckets[key.name],
            )
        return KeyTable(table, buckets)

    def use_keys(self, table: KeyTable, *, required: bool) -> None:
        self._keys, self._buckets, self._required = table.keys, table.buckets, required

    @property
    def enabled(self) -> bool:
        return self._required or self._oidc is not None

    async def authenticate(self, token: str | None, scope: str, *, charge: bool = True) -> Principal:
        """Who may make a call needing `scope` with `token` (an API key, the suite's admin
        credential for `admin`, or, with OIDC on, a JWT); else the matching error. Charging
        is as for `authorize`."""
        if token and scope == ADMIN and self._is_admin_token is not None and self._is_admin_token(token):
            return SUITE_ADMIN
        if self._oidc is None or not token or not looks_like_jwt(token):
            if self._oidc is not None and not self._keys:
                if not token:
                    raise UnauthenticatedError("a bearer token is required (Authorization: Bearer <token>)")
                raise UnauthenticatedError("the bearer token is not a JWT")
            key = self._check(token, scope, charge=charge)
            if key is None:
                return Principal("", "none")
            return Principal(key.name, "api_key", key.tenant)
        claims = await self._oidc.verify(token)
        if scope not in claims.scopes:
            raise PermissionDeniedError(
                f"the token of '{claims.subject}' lacks the '{scope}' scope "
                f"(claim '{self._oidc_settings.scopes_claim}')"
            )
        bucket = self._subject_bucket(claims.subject)
        if charge and bucket is not None and not bucket.take(self._clock.monotonic()):
            raise bucket.refused(
                f"subject '{claims.subject}' exceeded its rate limit of "
                f"{self._oidc_settings.rate_per_s:g} requests/s"
            )
        return Principal(claims.subject, "oidc", claims.subject)

    def _subject_bucket(self, subject: str) -> TokenBucket | None:
        settings = self._oidc_settings
        bucket = self._subjects.get(subject)
        if bucket is None:
            if settings.rate_per_s <= 0:
                return None
            capacity = float(settings.burst or max(1.0, settings.rate_per_s))
            bucket = self._subjects[subject] = TokenBucket(
                settings.rate_per_s, capacity, capacity, self._clock.monotonic()
            )
            if len(self._subjects) > settings.max_subjects:
                self._subjects.popitem(last=False)
        else:
            self._subjects.move_to_end(subject)
        return bucket

    async def close(self) -> None:
        if self._oidc is not None:
            await self._oidc.close()

    def authorize(self, token: str | None, scope: str, *, charge: bool = True) -> str:
        """The key's name if `token` may make a call needing `scope` ("" in open mode); else
        the matching error.

        Each call takes one token from the key's rate-limit bucket, unless `charge` is False
        (a stream's opening: each of its messages is charged as it arrives)."""
        key = self._check(token, scope, charge=charge)
        return "" if key is None else key.name

    def identify(self, token: str | None) -> Principal:
        """Whose API key `token` is, without checking its scope, expiry or rate (to audit a
        refused call); nobody when it is no key."""
        key = self._keys.get(hashlib.sha256(token.encode()).digest()) if token else None
        return Principal("", "none") if key is None else Principal(key.name, "api_key", key.tenant)

    def _check(self, token: str | None, scope: str, *, charge: bool) -> _Key | None:
        if not self.enabled:
            return None
        if not token:
            raise UnauthenticatedError("an API key is required (Authorization: Bearer <key>)")
        digest = hashlib.sha256(token.encode()).digest()
        key = self._keys.get(digest)
        if key is None or not hmac.compare_digest(key.digest, digest):
            raise UnauthenticatedError("the API key is not valid")
        if key.expires_unix_s is not None and self._clock.time() >= key.expires_unix_s:
            raise UnauthenticatedError(f"API key '{key.name}' has expired")
        if scope not in key.scopes:
            raise PermissionDeniedError(f"API key '{key.name}' lacks the '{scope}' scope")
        if charge and key.bucket is not None and not key.bucket.take(self._clock.monotonic()):
            raise key.bucket.refused(
                f"API key '{key.name}' exceeded its rate limit of {key.bucket.rate_per_s:g} requests/s"
            )
        return key
