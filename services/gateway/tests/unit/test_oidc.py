"""The OIDC verifier and its key cache, with keys made here and a fake clock (no sockets: the
key set is fetched by a function, as PyJWKClient would return it)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt import PyJWK
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from loadmaster.common.clock import FakeClock
from loadmaster.common.errors import PermissionDeniedError, ResourceExhaustedError, UnauthenticatedError
from loadmaster.common.gateway_config import ApiKeySettings, GatewaySettings, OidcSettings
from loadmaster.gateway.auth import Authenticator, hash_key
from loadmaster.gateway.exposure import exposed_without_auth
from loadmaster.gateway.oidc import JwksKeys, OidcVerifier, looks_like_jwt, scopes_from_claims

ISSUER = "https://id.example"
AUDIENCE = "loadmaster"


class Issuer:
    def __init__(self) -> None:
        self.keys: dict[str, Any] = {"r1": rsa.generate_private_key(public_exponent=65537, key_size=2048)}
        self.published = ["r1"]
        self.fetches = 0
        self.fail = False

    def add_ec(self, kid: str) -> None:
        self.keys[kid] = ec.generate_private_key(ec.SECP256R1())

    def fetch(self) -> list[PyJWK]:
        self.fetches += 1
        if self.fail:
            raise OSError("connection refused")
        out = []
        for kid in self.published:
            private = self.keys[kid]
            algorithm = ECAlgorithm if isinstance(private, ec.EllipticCurvePrivateKey) else RSAAlgorithm
            out.append(PyJWK.from_dict({**json.loads(algorithm.to_jwk(private.public_key())), "kid": kid}))
        return out

    def token(self, kid: str = "r1", **claims: Any) -> str:
        private = self.keys[kid]
        alg = "ES256" if isinstance(private, ec.EllipticCurvePrivateKey) else "RS256"
        body = {
            "iss": ISSUER,
            "aud": AUDIENCE,
            "sub": "alice",
            "exp": int(time.time()) + 3600,
            "scope": "loadmaster:infer",
        }
        body |= claims
        return jwt.encode(
            {k: v for k, v in body.items() if v is not None}, private, algorithm=alg, headers={"kid": kid}
        )


async def fetched(issuer: Issuer, count: int) -> None:
    """Wait (bounded) for the background refresh to have fetched `count` times in all."""
    for _ in range(500):
        if issuer.fetches >= count and not any(t.get_name() == "jwks-fetch" for t in asyncio.all_tasks()):
            break
        await asyncio.sleep(0.01)
    assert issuer.fetches == count


def verifier(issuer: Issuer, clock: FakeClock, **settings: Any) -> OidcVerifier:
    config = OidcSettings(issuer=ISSUER, audience=[AUDIENCE], **settings)
    keys = JwksKeys(
        issuer.fetch,
        cache_s=config.jwks_cache_s,
        refetch_interval_s=config.jwks_refetch_interval_s,
        clock=clock,
    )
    return OidcVerifier(config, keys=keys, clock=clock)


async def test_a_good_token_gives_its_subject_and_mapped_scopes() -> None:
    issuer = Issuer()
    claims = await verifier(issuer, FakeClock(epoch=time.time())).verify(
        issuer.token(scope="openid loadmaster:infer other")
    )
    assert (claims.subject, claims.scopes) == ("alice", frozenset({"infer"}))


async def test_the_key_set_is_fetched_once_and_an_unknown_kid_refetches_at_most_once_per_interval() -> None:
    issuer, clock = Issuer(), FakeClock(epoch=time.time())
    check = verifier(issuer, clock, jwks_refetch_interval_s=30)
    await check.verify(issuer.token())
    await check.verify(issuer.token())
    assert issuer.fetches == 1
    issuer.add_ec("e2")  # rotated in, not yet published
    for _ in range(5):  # made-up or not-yet-published kids: one fetch per interval, not per token
        with pytest.raises(UnauthenticatedError, match="'e2' is not in the issuer's key set"):
            await check.verify(issuer.token("e2"))
    assert issuer.fetches == 1  # the first fetch was just now: within the interval
    issuer.published.append("e2")
    clock.advance(30)
    assert (await check.verify(issuer.token("e2"))).subject == "alice"  # ES256 from the new set
    assert issuer.fetches == 2


async def test_concurrent_tokens_share_one_fetch() -> None:
    issuer = Issuer()
    check = verifier(issuer, FakeClock(epoch=time.time()))
    results = await asyncio.gather(*(check.verify(issuer.token(sub=f"s{i}")) for i in range(10)))
    assert [r.subject for r in results] == [f"s{i}" for i in range(10)] and issuer.fetches == 1


async def test_a_stale_set_is_refreshed_in_the_background_and_kept_when_the_refresh_fails() -> None:
    issuer, clock = Issuer(), FakeClock(epoch=time.time())
    check = verifier(issuer, clock, jwks_cache_s=300)
    await check.verify(issuer.token(sub="s1"))
    clock.advance(301)
    issuer.fail = True
    await check.verify(issuer.token(sub="s2"))  # answered from the old keys while the refresh runs
    await fetched(issuer, 2)
    await check.verify(issuer.token(sub="s3"))  # still fine: a failed refresh keeps the keys
    await fetched(issuer, 3)  # the set is still stale: another try, failing too
    issuer.fail = False
    issuer.published = []  # the issuer dropped r1: after the next refresh it is gone
    await check.verify(issuer.token(sub="s4"))
    await fetched(issuer, 4)
    clock.advance(31)
    with pytest.raises(UnauthenticatedError, match="not in the issuer's key set"):
        await check.verify(issuer.token(sub="late"))  # another token: a verified one is remembered


@pytest.mark.parametrize(
    ("claims", "message"),
    [
        ({"exp": int(time.time()) - 3600}, "expired"),
        ({"aud": "other"}, "not meant for this service"),
        ({"iss": "https://evil.example"}, "another issuer"),
        ({"nbf": int(time.time()) + 3600}, "not valid yet"),
        ({"sub": None}, "lacks the 'sub' claim"),
        ({"aud": None}, "lacks the 'aud' claim"),
    ],
)
async def test_bad_claims_are_refused_naming_the_problem(claims: dict[str, Any], message: str) -> None:
    issuer = Issuer()
    with pytest.raises(UnauthenticatedError, match=message):
        await verifier(issuer, FakeClock(epoch=time.time())).verify(issuer.token(**claims))


async def test_alg_none_and_hs256_and_missing_kid_are_refused() -> None:
    issuer = Issuer()
    check = verifier(issuer, FakeClock(epoch=time.time()))
    body = {"iss": ISSUER, "aud": AUDIENCE, "sub": "eve", "exp": int(time.time()) + 60}
    with pytest.raises(UnauthenticatedError, match="'none' is not accepted"):
        await check.verify(jwt.encode(body, None, algorithm="none", headers={"kid": "r1"}))
    with pytest.raises(UnauthenticatedError, match="'HS256' is not accepted"):
        await check.verify(jwt.encode(body, "k" * 32, algorithm="HS256", headers={"kid": "r1"}))
    with pytest.raises(UnauthenticatedError, match="names no key"):
        await check.verify(jwt.encode(body, issuer.keys["r1"], algorithm="RS256"))
    with pytest.raises(UnauthenticatedError, match="not a valid JWT"):
        await check.verify("eyJhbGciOi.not.valid")


def test_scopes_come_from_a_string_a_list_or_a_dotted_path() -> None:
    mapping = {"lm-users": ["infer"], "lm-admins": ["admin", "infer"]}
    assert scopes_from_claims({"roles": ["lm-admins", "x"]}, "roles", mapping) == {"admin", "infer"}
    assert scopes_from_claims({"realm_access": {"roles": ["lm-users"]}}, "realm_access.roles", mapping) == {
        "infer"
    }
    assert scopes_from_claims({"scope": "a lm-users"}, "scope", mapping) == {"infer"}
    assert scopes_from_claims({"scope": 7}, "scope", mapping) == frozenset()
    assert scopes_from_claims({}, "realm_access.roles", mapping) == frozenset()


def test_an_issuer_without_an_audience_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="audience must name this service"):
        OidcSettings(issuer=ISSUER)


async def test_the_authenticator_takes_keys_and_tokens_with_scopes_and_a_bucket_per_subject() -> None:
    issuer, clock = Issuer(), FakeClock(epoch=time.time())
    settings = OidcSettings(issuer=ISSUER, audience=[AUDIENCE], rate_per_s=1.0, burst=2)
    keys = JwksKeys(issuer.fetch, cache_s=300, refetch_interval_s=30, clock=clock)
    auth = Authenticator(
        [ApiKeySettings(name="ops", sha256=hash_key("lm_k"))],
        clock=clock,
        oidc=OidcVerifier(settings, keys=keys),
        oidc_settings=settings,
    )
    assert looks_like_jwt(issuer.token()) and not looks_like_jwt("lm_k")
    assert (await auth.authenticate("lm_k", "infer")).method == "api_key"
    alice = issuer.token()
    assert await auth.authenticate(alice, "infer") == await auth.authenticate(alice, "infer")
    with pytest.raises(ResourceExhaustedError, match="subject 'alice'"):
        await auth.authenticate(alice, "infer")
    assert (await auth.authenticate(issuer.token(sub="bob"), "infer")).name == "bob"  # its own bucket
    await auth.authenticate(alice, "infer", charge=False)  # a stream's opening is not charged
    clock.advance(1.0)
    assert (await auth.authenticate(alice, "infer")).method == "oidc"
    with pytest.raises(PermissionDeniedError, match="lacks the 'admin' scope"):
        await auth.authenticate(alice, "admin")
    with pytest.raises(UnauthenticatedError):
        await auth.authenticate(None, "infer")


async def test_with_oidc_alone_a_token_is_required() -> None:
    issuer = Issuer()
    settings = OidcSettings(issuer=ISSUER, audience=[AUDIENCE])
    auth = Authenticator(
        [],
        oidc=OidcVerifier(settings, keys=JwksKeys(issuer.fetch, cache_s=300, refetch_interval_s=30)),
        oidc_settings=settings,
    )
    assert auth.enabled
    with pytest.raises(UnauthenticatedError, match="bearer token is required"):
        await auth.authenticate(None, "infer")
    with pytest.raises(UnauthenticatedError, match="not a JWT"):
        await auth.authenticate("lm_anything", "infer")


async def test_a_verified_token_is_remembered_until_it_expires() -> None:
    issuer, clock = Issuer(), FakeClock(epoch=time.time())
    check = verifier(issuer, clock, leeway_s=30)
    exp = int(time.time()) + 60
    token = issuer.token(exp=exp)
    assert (await check.verify(token)).subject == "alice"
    issuer.published = []
    issuer.keys["r1"] = None  # a second full verification could not even sign: the cache answers
    assert (await check.verify(token)).subject == "alice"
    clock.advance(exp + 30 - clock.time())  # the fake clock reaches the token's exp + leeway
    with pytest.raises(UnauthenticatedError, match="expired"):
        await check.verify(token)


def test_one_audience_may_be_written_as_a_string() -> None:
    assert OidcSettings(issuer=ISSUER, audience="svc").audience == ["svc"]


def test_oidc_alone_counts_as_authentication_for_the_exposure_warning() -> None:
    settings = GatewaySettings.model_validate(
        {
            "address": "0.0.0.0:8001",
            "http_host": "0.0.0.0",
            "auth": {"oidc": {"issuer": ISSUER, "audience": AUDIENCE}},
        }
    )
    assert exposed_without_auth(settings) == []
