"""The admin API through two real gateway processes sharing one real redis-server (no
scheduler behind them: a request that passes auth and policy is answered 503, one that does
not is answered 401/403/400). Every verb, its refusal without the admin scope, its audit
line, its effect on the other gateway, a gateway started later, Redis down and back."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadmaster.cli.redis_server import EmbeddedRedis
from loadmaster.gateway.auth import hash_key

ADMIN_KEY = "lm_admin-" + uuid.uuid4().hex
READER_KEY = "lm_reader-" + uuid.uuid4().hex
INFER = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
EFFECT_BOUND_S = 5.0  # generous: the pub/sub delay is measured by bench/admin_plane.py


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="module")
def gateways(
    start_gateway: Callable[..., Any], redis: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("admin-audit")
    made: dict[str, Any] = {"audit": folder, "start": None}

    def start(name: str, **gateway: Any) -> Any:
        config = {
            "auth": {
                "api_keys": [
                    {"name": "ops", "sha256": hash_key(ADMIN_KEY), "scopes": ["infer", "admin"]},
                    {"name": "reader", "sha256": hash_key(READER_KEY), "scopes": ["infer"]},
                ]
            },
            "audit": {"path": str(folder / f"{name}.jsonl")},  # request auditing stays off
            **gateway,
        }
        return start_gateway(
            config, redis_url=redis.url, top_level={"redis": {"admin_key_prefix": "admin-test"}}
        )

    made["start"] = start
    made["a"], made["b"] = start("a"), start("b")
    return made


def _admin_lines(folder: Path, name: str) -> list[dict[str, Any]]:
    path = folder / f"{name}.jsonl"
    deadline = time.monotonic() + EFFECT_BOUND_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _until(check: Callable[[], bool], what: str) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < EFFECT_BOUND_S, what
        time.sleep(0.02)
    return time.monotonic() - started


def _infer_status(url: str, key: str) -> int:
    return httpx.post(
        f"{url}/v2/models/double/infer", json=INFER, headers=_bearer(key), timeout=10
    ).status_code


def test_a_key_added_at_one_gateway_works_at_the_other_and_a_revoked_one_is_refused(
    gateways: dict[str, Any],
) -> None:
    a, b = gateways["a"].http_url, gateways["b"].http_url
    added = httpx.post(
        f"{a}/admin/v1/keys",
        json={"name": "svc", "rate_per_s": 50, "tenant": "team"},
        headers=_bearer(ADMIN_KEY),
    )
    assert added.status_code == 201, added.text
    key = added.json()["key"]
    assert key.startswith("lm_") and added.json()["tenant"] == "team"
    _until(lambda: _infer_status(b, key) == 503, "the new key never worked at gateway b")
    listed = httpx.get(f"{b}/admin/v1/keys", headers=_bearer(ADMIN_KEY)).json()["keys"]
    assert {k["name"]: k["state"] for k in listed} == {"ops": "active", "reader": "active", "svc": "active"}
    assert key not in json.dumps(listed) and hash_key(key) not in json.dumps(listed)  # only a prefix
    again = httpx.post(f"{b}/admin/v1/keys", json={"name": "svc"}, headers=_bearer(ADMIN_KEY))
    assert again.status_code == 409 and "exists" in again.json()["error"]

    revoked = httpx.delete(f"{b}/admin/v1/keys/svc", headers=_bearer(ADMIN_KEY))
    assert revoked.status_code == 200 and revoked.json()["state"] == "revoked"
    _until(lambda: _infer_status(a, key) == 401, "the revoked key still worked at gateway a")
    assert httpx.delete(f"{a}/admin/v1/keys/svc", headers=_bearer(ADMIN_KEY)).status_code == 404

    lines = _admin_lines(gateways["audit"], "a")
    add = next(line for line in lines if line["action"] == "keys.add" and line["target"] == "svc")
    assert (add["subject"], add["auth"], add["outcome"], add["old"]) == ("ops", "api_key", "ok", None)
    assert add["new"]["state"] == "active" and key not in json.dumps(lines)
    revoke = next(line for line in _admin_lines(gateways["audit"], "b") if line["action"] == "keys.revoke")
    assert (revoke["old"]["state"], revoke["new"]["state"]) == ("active", "revoked")


def test_a_rotated_key_keeps_the_old_one_for_its_grace_and_an_expiring_key_expires(
    gateways: dict[str, Any],
) -> None:
    a, b = gateways["a"].http_url, gateways["b"].http_url
    old = httpx.post(f"{a}/admin/v1/keys", json={"name": "rot"}, headers=_bearer(ADMIN_KEY)).json()["key"]
    rotated = httpx.patch(
        f"{a}/admin/v1/keys/rot", json={"rotate": True, "grace_s": 60}, headers=_bearer(ADMIN_KEY)
    )
    assert rotated.status_code == 200, rotated.text
    new = rotated.json()["key"]
    assert new != old and len(rotated.json()["grace"]) == 1
    _until(lambda: _infer_status(b, new) == 503, "the rotated key never worked at gateway b")
    assert _infer_status(b, old) == 503  # within its grace
    ended = httpx.patch(
        f"{a}/admin/v1/keys/rot", json={"rotate": True, "grace_s": 0}, headers=_bearer(ADMIN_KEY)
    )
    newest = ended.json()["key"]
    _until(
        lambda: _infer_status(b, new) == 401 and _infer_status(b, newest) == 503, "no grace: old key refused"
    )
    assert _infer_status(b, old) == 503  # the first rotation's grace still runs

    brief = httpx.post(
        f"{a}/admin/v1/keys", json={"name": "brief", "expires_in_s": 1.5}, headers=_bearer(ADMIN_KEY)
    )
    key = brief.json()["key"]
    _until(lambda: _infer_status(b, key) == 503, "the expiring key never worked")
    _until(lambda: _infer_status(b, key) == 401, "the key did not expire")
    refused = httpx.post(f"{b}/v2/models/double/infer", json=INFER, headers=_bearer(key))
    assert "expired" in refused.json()["error"]
    listed = {
        k["name"]: k for k in httpx.get(f"{a}/admin/v1/keys", headers=_bearer(ADMIN_KEY)).json()["keys"]
    }
    assert listed["brief"]["state"] == "expired"


@pytest.mark.parametrize(
    ("method", "path", "body", "action"),
    [
        ("GET", "/admin/v1/keys", None, ""),
        ("POST", "/admin/v1/keys", {"name": "sneaky"}, "keys.add"),
        ("PATCH", "/admin/v1/keys/reader", {"scopes": ["infer", "admin"]}, "keys.update"),
        ("DELETE", "/admin/v1/keys/ops", None, "keys.revoke"),
        ("GET", "/admin/v1/guardrails", None, ""),
        ("POST", "/admin/v1/guardrails", {"kind": "word", "value": "x"}, "guardrails.add"),
        ("DELETE", "/admin/v1/guardrails/g-000000000000", None, "guardrails.remove"),
        ("GET", "/admin/v1/config", None, ""),
        ("PUT", "/admin/v1/config", {"key": "models.allow_cloud_fallback", "value": False}, "config.set"),
        ("GET", "/admin/v1/queues", None, ""),
        ("POST", "/admin/v1/strategy", {"strategy": "round_robin"}, "config.set"),
    ],
)
def test_every_verb_needs_the_admin_scope(
    gateways: dict[str, Any], method: str, path: str, body: Any, action: str
) -> None:
    url = gateways["b"].http_url + path
    bare = httpx.request(method, url, json=body)
    assert bare.status_code == 401, bare.text
    reader = httpx.request(method, url, json=body, headers=_bearer(READER_KEY))
    assert reader.status_code == 403 and "admin" in reader.json()["error"]
    if action:  # an attempt to change something is audited, naming who tried

        def audited(outcome: str, subject: str) -> bool:
            return any(
                (line["action"], line["outcome"], line["subject"]) == (action, outcome, subject)
                for line in _admin_lines(gateways["audit"], "b")
            )

        _until(
            lambda: audited("unauthenticated", "") and audited("permission_denied", "reader"), "not audited"
        )


def test_guardrails_reach_the_other_gateway_and_bad_patterns_are_refused(gateways: dict[str, Any]) -> None:
    a, b = gateways["a"].http_url, gateways["b"].http_url
    chat = {"model": "tiny-chat", "messages": [{"role": "user", "content": "say zanzibar now"}]}

    def chat_status() -> int:
        return httpx.post(
            f"{b}/v1/chat/completions", json=chat, headers=_bearer(READER_KEY), timeout=10
        ).status_code

    assert chat_status() != 400
    added = httpx.post(
        f"{a}/admin/v1/guardrails", json={"kind": "word", "value": "Zanzibar"}, headers=_bearer(ADMIN_KEY)
    )
    assert added.status_code == 201, added.text
    rule = added.json()["id"]
    _until(lambda: chat_status() == 400, "the blocked word passed gateway b")
    listed = httpx.get(f"{b}/admin/v1/guardrails", headers=_bearer(ADMIN_KEY)).json()["guardrails"]
    assert [r["id"] for r in listed] == [rule] and listed[0]["created_by"] == "ops"
    bad = httpx.post(
        f"{a}/admin/v1/guardrails", json={"kind": "pattern", "value": "(unclosed"}, headers=_bearer(ADMIN_KEY)
    )
    assert bad.status_code == 400 and "regular expression" in bad.json()["error"]
    removed = httpx.delete(f"{b}/admin/v1/guardrails/{rule}", headers=_bearer(ADMIN_KEY))
    assert removed.status_code == 200 and removed.json()["removed"]
    _until(lambda: chat_status() != 400, "the removed word still blocked gateway b")
    actions = [line["action"] for line in _admin_lines(gateways["audit"], "a")]
    assert "guardrails.add" in actions


def test_runtime_settings_are_checked_shared_and_reset(gateways: dict[str, Any]) -> None:
    a, b = gateways["a"].http_url, gateways["b"].http_url

    def put(body: dict[str, Any]) -> httpx.Response:
        return httpx.put(f"{a}/admin/v1/config", json=body, headers=_bearer(ADMIN_KEY))

    def at_b(key: str) -> dict[str, Any]:
        reply: dict[str, Any] = httpx.get(
            f"{b}/admin/v1/config", params={"key": key}, headers=_bearer(ADMIN_KEY)
        ).json()
        return reply

    changed = put({"key": "models.allow_cloud_fallback", "value": False})
    assert changed.status_code == 200 and changed.json()["previous"] == {"models.allow_cloud_fallback": True}
    _until(lambda: at_b("models.allow_cloud_fallback")["value"] is False, "gateway b kept the old value")
    assert at_b("models.allow_cloud_fallback") == {
        "key": "models.allow_cloud_fallback",
        "value": False,
        "configured": True,
        "stored": True,
    }
    assert (
        put({"values": {"tenants.team.weight": 3, "models.known.double.keep_alive_s": 30}}).status_code == 200
    )
    _until(lambda: at_b("tenants.team.weight")["value"] == 3, "the tenant weight did not reach gateway b")

    refused = put({"key": "tenants.team.weight", "value": -1})
    assert refused.status_code == 400 and "tenants.team.weight" in refused.json()["error"]
    unknown = put({"key": "gateway.http_port", "value": 1})
    assert unknown.status_code == 400 and "cannot be set at run time" in unknown.json()["error"]
    alias = put({"key": "models.aliases.chat", "value": ["no-such-model"]})
    assert alias.status_code == 400 and "no-such-model" in alias.json()["error"]
    strategy = put({"key": "scheduler.strategy", "value": "no-such-strategy"})
    assert strategy.status_code == 400 and "no-such-strategy" in strategy.json()["error"]
    no_scheduler = put({"key": "scheduler.strategy", "value": "round_robin"})
    assert no_scheduler.status_code == 503  # nothing is stored that the scheduler did not take
    assert at_b("scheduler.strategy")["stored"] is False

    reset = put({"key": "models.allow_cloud_fallback", "reset": True})
    assert reset.status_code == 200 and reset.json()["values"] == {"models.allow_cloud_fallback": True}
    _until(
        lambda: at_b("models.allow_cloud_fallback")["stored"] is False, "the reset did not reach gateway b"
    )
    lines = [
        line
        for line in _admin_lines(gateways["audit"], "a")
        if line["target"] == "models.allow_cloud_fallback"
    ]
    assert [(line["action"], line["old"], line["new"]) for line in lines if line["outcome"] == "ok"] == [
        ("config.set", True, False),
        ("config.reset", False, True),
    ]
    assert any(line["outcome"] == "invalid_argument" for line in _admin_lines(gateways["audit"], "a"))


def test_a_gateway_started_later_serves_the_stored_state_and_warns_about_the_file(
    gateways: dict[str, Any],
) -> None:
    a = gateways["a"].http_url
    key = httpx.post(f"{a}/admin/v1/keys", json={"name": "late"}, headers=_bearer(ADMIN_KEY)).json()["key"]
    assert (
        httpx.put(
            f"{a}/admin/v1/config",
            json={"key": "models.allow_cloud_fallback", "value": False},
            headers=_bearer(ADMIN_KEY),
        ).status_code
        == 200
    )
    assert (
        httpx.delete(f"{a}/admin/v1/keys/reader", headers=_bearer(ADMIN_KEY)).status_code == 200
    )  # a file key
    late = gateways["start"]("late")
    assert _infer_status(late.http_url, key) == 503  # from its first request on
    assert _infer_status(late.http_url, READER_KEY) == 401  # revoked, though the file lists it
    log = late.log_text()
    assert (
        "models.allow_cloud_fallback: the value set at run time (False) wins over the configuration file's (True)"
        in log
    )
    assert "gateway.auth.api_keys 'reader': the key was revoked at run time" in log


def test_keys_are_required_by_the_setting_not_by_the_first_key(
    start_gateway: Callable[..., Any], redis: EmbeddedRedis
) -> None:
    top = {"redis": {"admin_key_prefix": "admin-open-" + uuid.uuid4().hex[:6]}}
    gateway = start_gateway({}, redis_url=redis.url, top_level=top)  # no keys in the file: open
    url = gateway.http_url
    added = httpx.post(f"{url}/admin/v1/keys", json={"name": "first", "scopes": ["admin", "infer"]})
    assert added.status_code == 201
    key = added.json()["key"]
    assert httpx.post(f"{url}/v2/models/double/infer", json=INFER).status_code == 503  # still open
    assert (
        httpx.put(f"{url}/admin/v1/config", json={"key": "gateway.auth.required", "value": True}).status_code
        == 200
    )
    assert httpx.post(f"{url}/v2/models/double/infer", json=INFER).status_code == 401
    assert _infer_status(url, key) == 503
    back = httpx.put(
        f"{url}/admin/v1/config", json={"key": "gateway.auth.required", "reset": True}, headers=_bearer(key)
    )
    assert back.status_code == 200
    assert httpx.post(f"{url}/v2/models/double/infer", json=INFER).status_code == 503


def test_with_redis_down_gateways_serve_on_what_they_read_and_catch_up_after(
    gateways: dict[str, Any], redis: EmbeddedRedis
) -> None:
    a, b = gateways["a"].http_url, gateways["b"].http_url
    key = httpx.post(f"{a}/admin/v1/keys", json={"name": "steady"}, headers=_bearer(ADMIN_KEY)).json()["key"]
    _until(lambda: _infer_status(b, key) == 503, "the key never reached gateway b")
    redis._kill()  # a crash; its append-only file keeps what was written
    try:
        for url in (a, b):
            assert _infer_status(url, key) == 503
            assert _infer_status(url, "lm_unknown") == 401
        down = httpx.post(f"{a}/admin/v1/keys", json={"name": "while-down"}, headers=_bearer(ADMIN_KEY))
        assert down.status_code == 503 and "Redis" in down.json()["error"]
        assert httpx.get(f"{b}/admin/v1/keys", headers=_bearer(ADMIN_KEY)).status_code == 200  # from memory
    finally:
        redis.start()
    later = ""

    def added_after() -> bool:
        nonlocal later
        reply = httpx.post(f"{a}/admin/v1/keys", json={"name": "after"}, headers=_bearer(ADMIN_KEY))
        if reply.status_code == 201:
            later = reply.json()["key"]
        return bool(later) or reply.status_code == 409

    _until(added_after, "no key could be added after Redis came back")
    assert later
    _until(lambda: _infer_status(b, later) == 503, "gateway b did not catch up after Redis came back")
    assert _infer_status(b, key) == 503  # the data came back with Redis
