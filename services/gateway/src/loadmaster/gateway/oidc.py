"""OIDC bearer tokens: JWTs verified against the issuer's JWKS, beside API keys.

PyJWT does the cryptography and the claim checks (`jwt.decode`: signature, `iss`, `aud`,
`exp`, `nbf`, with the algorithms pinned to RS256/ES256, so an `alg: none` or HS256 token
signed with the public key is refused). Its `PyJWKClient` fetches and parses the key set
(http(s) only, no redirects, a timeout). The fetch is blocking `urllib`, so it runs in a
thread; the cache and its policy are `JwksKeys`', on the event loop, with an injected clock:

- the first token fetches the set; later ones find their key by `kid` without any I/O;
- a `kid` the set lacks (the issuer rotated its keys) refetches it, at most once per
  `jwks_refetch_interval_s`, so tokens with made-up `kid`s cannot make the gateway hammer
  the issuer; concurrent tokens share one fetch;
- a set older than `jwks_cache_s` is refreshed in the background while the old keys keep
  verifying (a failed refresh keeps them, and is logged).

Verifying a token costs 0.1-0.3 ms (RS256 2048 / ES256 P-256, PyJWT, on a loaded 2-core
machine), done on the loop; a client sends the same token with many requests, so verified
tokens are remembered (up to `VERIFIED_TOKENS`, each until its `exp` plus the leeway) and a
repeat costs a dictionary lookup.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jwt
from jwt import PyJWK, PyJWKClient

from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.errors import UnauthenticatedError
from loadmaster.common.gateway_config import OidcSettings

__all__ = ["JwksKeys", "OidcVerifier", "TokenClaims", "looks_like_jwt", "scopes_from_claims"]

log = logging.getLogger(__name__)

Fetch = Callable[[], list[PyJWK]]  # blocking: run in a thread
VERIFIED_TOKENS = 4096  # verified tokens remembered (least recently used go first)


def looks_like_jwt(token: str) -> bool:
    """A compact JWS (`header.payload.signature`); API keys (`lm_...`) have no dots."""
    return token.count(".") == 2 and token.startswith("eyJ")


@dataclass(frozen=True, slots=True)
class TokenClaims:
    """A verified token: its issuer and subject, and the Loadmaster scopes it grants."""

    issuer: str
    subject: str
    scopes: frozenset[str]


def scopes_from_claims(
    claims: Mapping[str, Any], claim: str, scope_map: Mapping[str, list[str]]
) -> frozenset[str]:
    """The Loadmaster scopes that `claims[claim]` maps to (`claim` may be a dotted path)."""
    value: Any = claims
    for part in claim.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    if isinstance(value, str):
        granted = value.split()
    elif isinstance(value, list):
        granted = [item for item in value if isinstance(item, str)]
    else:
        granted = []
    return frozenset(scope for name in granted for scope in scope_map.get(name, ()))


class JwksKeys:
    """The issuer's signing keys by `kid`, fetched by `fetch` (in a thread) and cached."""

    def __init__(
        self, fetch: Fetch, *, cache_s: float, refetch_interval_s: float, clock: Clock | None = None
    ) -> None:
        self._fetch = fetch
        self._cache_s = cache_s
        self._refetch_interval_s = refetch_interval_s
        self._clock: Clock = clock or SystemClock()
        self._keys: dict[str, PyJWK] = {}
        self._fetched_at: float | None = None  # of the last successful fetch
        self._tried_at: float | None = None  # of the last attempt
        self._refreshing: asyncio.Task[None] | None = None
        self.fetches = 0  # attempts, for tests and logs

    async def key(self, kid: str) -> PyJWK:
        """The key named `kid`; `UnauthenticatedError` when the issuer has none by that name."""
        now = self._clock.monotonic()
        key = self._keys.get(kid)
        if key is not None:
            assert self._fetched_at is not None
            if now - self._fetched_at >= self._cache_s:
                self._refresh()  # in the background: the current keys still verify
            return key
        in_flight = self._refreshing is not None and not self._refreshing.done()
        if in_flight or self._tried_at is None or now - self._tried_at >= self._refetch_interval_s:
            await asyncio.shield(self._refresh())
            key = self._keys.get(kid)
        if key is None:
            raise UnauthenticatedError(f"the token's key '{kid}' is not in the issuer's key set")
        return key

    def _refresh(self) -> asyncio.Task[None]:
        if self._refreshing is None or self._refreshing.done():
            self._tried_at = self._clock.monotonic()
            self._refreshing = asyncio.create_task(self._fetch_keys(), name="jwks-fetch")
        return self._refreshing

    async def _fetch_keys(self) -> None:
        self.fetches += 1
        try:
            keys = await asyncio.to_thread(self._fetch)
        except Exception as error:  # the old keys stay; the next unknown kid may try again
            log.warning("could not fetch the issuer's key set: %s", error)
            return
        self._keys = {key.key_id: key for key in keys if key.key_id}
        self._fetched_at = self._clock.monotonic()
        log.info("fetched the issuer's key set: %d signing key(s)", len(self._keys))

    async def close(self) -> None:
        if self._refreshing is not None and not self._refreshing.done():
            self._refreshing.cancel()


def jwks_fetcher(settings: OidcSettings) -> Fetch:
    """Blocking: the signing keys at `jwks_url`, or at the `jwks_uri` of the issuer's discovery
    document (read once)."""
    timeout = settings.jwks_timeout_s
    url = settings.jwks_url
    client: PyJWKClient | None = PyJWKClient(url, cache_jwk_set=False, timeout=timeout) if url else None

    def fetch() -> list[PyJWK]:
        nonlocal client
        if client is None:
            discovery = settings.issuer.rstrip("/") + "/.well-known/openid-configuration"
            document = PyJWKClient(discovery, cache_jwk_set=False, timeout=timeout).fetch_data()
            jwks_uri = document.get("jwks_uri")
            if not isinstance(jwks_uri, str) or not jwks_uri:
                raise ValueError(f"{discovery} names no jwks_uri")
            client = PyJWKClient(jwks_uri, cache_jwk_set=False, timeout=timeout)
        return client.get_signing_keys(refresh=True)

    return fetch


class OidcVerifier:
    """Bearer JWT -> `TokenClaims`, or `UnauthenticatedError` naming what was wrong."""

    def __init__(
        self, settings: OidcSettings, *, keys: JwksKeys | None = None, clock: Clock | None = None
    ) -> None:
        self._settings = settings
        self._algorithms = list(dict.fromkeys(settings.algorithms))
        self._clock: Clock = clock or SystemClock()
        self._verified: OrderedDict[str, tuple[TokenClaims, float]] = OrderedDict()  # -> claims, valid until
        self.keys = keys or JwksKeys(
            jwks_fetcher(settings),
            cache_s=settings.jwks_cache_s,
            refetch_interval_s=settings.jwks_refetch_interval_s,
            clock=clock,
        )

    async def verify(self, token: str) -> TokenClaims:
        remembered = self._verified.get(token)
        if remembered is not None:
            if self._clock.time() < remembered[1]:
                self._verified.move_to_end(token)
                return remembered[0]
            del self._verified[token]
        claims, expires = await self._verify(token)
        self._verified[token] = (claims, expires)
        if len(self._verified) > VERIFIED_TOKENS:
            self._verified.popitem(last=False)
        return claims

    async def _verify(self, token: str) -> tuple[TokenClaims, float]:
        settings = self._settings
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise UnauthenticatedError("the bearer token is not a valid JWT") from None
        alg, kid = header.get("alg"), header.get("kid")
        if alg not in self._algorithms:
            raise UnauthenticatedError(
                f"the token's algorithm '{alg}' is not accepted (accepted: {', '.join(self._algorithms)})"
            )
        if not isinstance(kid, str) or not kid:
            raise UnauthenticatedError("the token names no key ('kid' header)")
        key = await self.keys.key(kid)
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=[str(alg)],
                audience=settings.audience or None,
                issuer=settings.issuer,
                leeway=settings.leeway_s,
                # exp and nbf are checked below against the injected clock
                options={
                    "require": ["exp", "iss", "aud", settings.subject_claim],
                    "verify_exp": False,
                    "verify_nbf": False,
                    "verify_iat": False,
                },
            )
        except jwt.InvalidAudienceError:
            raise UnauthenticatedError("the token is not meant for this service (aud)") from None
        except jwt.InvalidIssuerError:
            raise UnauthenticatedError("the token is from another issuer (iss)") from None
        except jwt.InvalidSignatureError:
            raise UnauthenticatedError("the token's signature does not verify") from None
        except jwt.MissingRequiredClaimError as error:
            raise UnauthenticatedError(f"the token lacks the '{error.claim}' claim") from None
        except jwt.PyJWTError as error:
            raise UnauthenticatedError(f"the token is not valid: {error}") from None
        now, leeway = self._clock.time(), settings.leeway_s
        exp, nbf = claims["exp"], claims.get("nbf")
        if not isinstance(exp, int | float) or not isinstance(nbf, int | float | None):
            raise UnauthenticatedError("the token's 'exp' and 'nbf' claims must be numbers")
        if exp <= now - leeway:
            raise UnauthenticatedError("the token has expired")
        if nbf is not None and nbf > now + leeway:
            raise UnauthenticatedError("the token is not valid yet (nbf)")
        subject = claims.get(settings.subject_claim)
        if not isinstance(subject, str) or not subject:
            raise UnauthenticatedError(f"the token's '{settings.subject_claim}' claim is not a string")
        verified = TokenClaims(
            issuer=settings.issuer,
            subject=subject,
            scopes=scopes_from_claims(claims, settings.scopes_claim, settings.scope_map),
        )
        return verified, float(claims["exp"]) + settings.leeway_s

    async def close(self) -> None:
        await self.keys.close()
