"""API keys: hashing, scopes, token buckets on a fake clock; exposure warnings; CURVE allow list."""

from __future__ import annotations

import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.common.errors import PermissionDeniedError, ResourceExhaustedError, UnauthenticatedError
from loadmaster.common.gateway_config import ApiKeySettings, GatewaySettings
from loadmaster.gateway.auth import ADMIN, INFER, Authenticator, bearer_token, hash_key, new_api_key
from loadmaster.gateway.curve import AllowedClients
from loadmaster.gateway.exposure import exposed_without_auth, is_loopback


def _key(name: str, key: str, scopes: list[str], **extra: object) -> ApiKeySettings:
    return ApiKeySettings.model_validate({"name": name, "sha256": hash_key(key), "scopes": scopes, **extra})


def test_open_when_no_keys() -> None:
    assert Authenticator([]).authorize(None, ADMIN) == ""


def test_scopes_and_unknown_keys() -> None:
    auth = Authenticator([_key("reader", "k1", ["infer"]), _key("ops", "k2", ["infer", "admin"])])
    assert auth.authorize("k1", INFER) == "reader"
    assert auth.authorize("k2", ADMIN) == "ops"
    with pytest.raises(PermissionDeniedError, match="'reader' lacks the 'admin' scope"):
        auth.authorize("k1", ADMIN)
    with pytest.raises(UnauthenticatedError, match="required"):
        auth.authorize(None, INFER)
    with pytest.raises(UnauthenticatedError, match="not valid") as raised:
        auth.authorize("k3", INFER)
    assert "k3" not in str(raised.value)


def test_token_bucket_refills_with_the_clock() -> None:
    clock = FakeClock()
    auth = Authenticator([_key("bot", "k", ["infer"], rate_per_s=2, burst=3)], clock=clock)
    for _ in range(3):
        auth.authorize("k", INFER)
    with pytest.raises(ResourceExhaustedError, match="rate limit of 2 requests/s"):
        auth.authorize("k", INFER)
    clock.advance(0.5)  # one token back
    auth.authorize("k", INFER)
    with pytest.raises(ResourceExhaustedError):
        auth.authorize("k", INFER)
    clock.advance(100)  # never more than the burst
    for _ in range(3):
        auth.authorize("k", INFER)
    with pytest.raises(ResourceExhaustedError):
        auth.authorize("k", INFER)


def test_bearer_parsing_and_new_keys() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None
    key = new_api_key()
    assert key.startswith("lm_") and len(key) > 40 and new_api_key() != key
    with pytest.raises(ValueError):
        ApiKeySettings.model_validate({"name": "x", "sha256": "not-a-hash"})


def test_exposure_warnings() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("gateway")
    assert exposed_without_auth(GatewaySettings()) == []
    exposed = GatewaySettings.model_validate(
        {"address": "0.0.0.0:8001", "http_host": "0.0.0.0", "edge": {"bind": "tcp://*:5555"}}
    )
    assert len(exposed_without_auth(exposed)) == 3
    secured = GatewaySettings.model_validate(
        {
            "address": "0.0.0.0:8001",
            "http_host": "0.0.0.0",
            "edge": {"bind": "tcp://0.0.0.0:5555"},
            "auth": {
                "api_keys": [{"name": "a", "sha256": hash_key("k")}],
                "curve": {"server_secret_key": "x" * 40},
            },
        }
    )
    assert exposed_without_auth(secured) == []


def test_curve_allow_list() -> None:
    assert AllowedClients(frozenset()).callback("*", b"anything")
    allowed = AllowedClients(frozenset({b"key-a"}))
    assert allowed.callback("*", b"key-a")
    assert not allowed.callback("*", b"key-b")


def test_keys_are_not_required_unless_configured_so() -> None:
    assert Authenticator([_key("a", "k", ["infer"])], required=False).authorize(None, ADMIN) == ""
    strict = Authenticator([], required=True)
    with pytest.raises(UnauthenticatedError, match="required"):
        strict.authorize(None, INFER)
    with pytest.raises(UnauthenticatedError, match="not valid"):
        strict.authorize("anything", INFER)


def test_replacing_the_keys_swaps_them_and_keeps_an_unchanged_bucket() -> None:
    clock = FakeClock()
    auth = Authenticator([_key("bot", "k", ["infer"], rate_per_s=1, burst=1)], clock=clock)
    auth.authorize("k", INFER)  # the one token of the bucket is spent
    auth.replace_keys(
        [_key("bot", "k", ["infer"], rate_per_s=1, burst=1), _key("new", "n", ["infer"])], required=True
    )
    with pytest.raises(ResourceExhaustedError):
        auth.authorize("k", INFER)  # same limits: same bucket, still empty
    assert auth.authorize("n", INFER) == "new"
    auth.replace_keys([_key("bot", "k", ["infer"], rate_per_s=5, burst=5)], required=True)
    assert auth.authorize("k", INFER) == "bot"  # new limits: a full bucket
    with pytest.raises(UnauthenticatedError, match="not valid"):
        auth.authorize("n", INFER)  # gone with the replacement


def test_an_expired_key_is_refused_naming_the_reason() -> None:
    clock = FakeClock()
    auth = Authenticator([_key("temp", "k", ["infer"], expires_unix_s=clock.time() + 10)], clock=clock)
    assert auth.authorize("k", INFER) == "temp"
    clock.advance(10)
    with pytest.raises(UnauthenticatedError, match="'temp' has expired"):
        auth.authorize("k", INFER)


async def test_the_suite_admin_credential_passes_for_the_admin_scope_only() -> None:
    auth = Authenticator([_key("reader", "k1", ["infer"])], admin_token=lambda token: token == "suite-secret")
    principal = await auth.authenticate("suite-secret", ADMIN)
    assert (principal.name, principal.method) == ("suite-admin", "admin_token")
    with pytest.raises(UnauthenticatedError):
        await auth.authenticate("suite-secret", INFER)
    with pytest.raises(PermissionDeniedError):
        await auth.authenticate("k1", ADMIN)
