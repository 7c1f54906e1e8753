"""API keys and guardrail rules: the configuration file's seed them, stored records win,
revocation and removal are remembered, a rotated key keeps its old hash for its grace."""

from __future__ import annotations

from loadmaster.common.gateway_config import ApiKeySettings
from loadmaster.gateway.auth import hash_key
from loadmaster.gateway.keyring import (
    KeyRecord,
    effective_keys,
    effective_rules,
    key_view,
    rule_id,
    stored_differs,
)

NOW = 1_800_000_000.0


def _configured(name: str, key: str, **extra: object) -> ApiKeySettings:
    return ApiKeySettings.model_validate({"name": name, "sha256": hash_key(key), **extra})


def _stored(name: str, key: str, **extra: object) -> dict[str, object]:
    return KeyRecord.model_validate({"name": name, "sha256": hash_key(key), **extra}).model_dump(mode="json")


def test_the_file_seeds_keys_and_a_stored_record_wins() -> None:
    configured = [_configured("a", "ka"), _configured("b", "kb", rate_per_s=5)]
    stored = {"b": _stored("b", "kb", rate_per_s=1), "c": _stored("c", "kc", scopes=["admin"])}
    serve, records = effective_keys(configured, stored, now_unix_s=NOW)
    by_name = {k.name: k for k in serve}
    assert set(by_name) == {"a", "b", "c"}
    assert by_name["b"].rate_per_s == 1 and by_name["c"].scopes == ["admin"]
    assert records["a"].source == "config" and records["c"].source == "api"
    assert stored_differs(configured[1], records["b"]) and not stored_differs(configured[0], records["a"])


def test_a_revoked_configured_key_stays_revoked() -> None:
    stored = {"a": _stored("a", "ka", revoked_unix_s=NOW - 1, source="config")}
    serve, records = effective_keys([_configured("a", "ka")], stored, now_unix_s=NOW)
    assert serve == [] and records["a"].revoked
    assert key_view(records["a"], now_unix_s=NOW)["state"] == "revoked"


def test_a_rotated_key_keeps_its_old_hash_until_the_grace_ends() -> None:
    stored = {
        "a": _stored(
            "a",
            "new",
            expires_unix_s=NOW + 50,
            grace=[
                {"sha256": hash_key("old"), "until_unix_s": NOW + 100},
                {"sha256": hash_key("older"), "until_unix_s": NOW - 1},
            ],
        )
    }
    serve, records = effective_keys([], stored, now_unix_s=NOW)
    by_hash = {k.sha256: k for k in serve}
    assert set(by_hash) == {hash_key("new"), hash_key("old")}
    assert by_hash[hash_key("old")].expires_unix_s == NOW + 50  # never past the key's own expiry
    view = key_view(records["a"], now_unix_s=NOW)
    assert len(view["grace"]) == 1 and "sha256" not in view and view["sha256_prefix"] == hash_key("new")[:12]


def test_an_unreadable_stored_key_is_ignored() -> None:
    serve, records = effective_keys([], {"x": {"name": "x", "sha256": "not-hex"}}, now_unix_s=NOW)
    assert serve == [] and records == {}


def test_rules_from_the_file_and_the_store_and_removal_by_id() -> None:
    word_id = rule_id("word", "secret")
    assert word_id == rule_id("word", "secret") != rule_id("pattern", "secret")
    stored = {
        word_id: {
            "id": word_id,
            "kind": "word",
            "value": "secret",
            "source": "config",
            "removed_unix_s": NOW,
        },
        rule_id("pattern", r"\d{4}"): {
            "id": rule_id("pattern", r"\d{4}"),
            "kind": "pattern",
            "value": r"\d{4}",
        },
        "g-bad": {"id": "g-bad", "kind": "pattern", "value": "("},  # does not compile: ignored
    }
    rules = effective_rules(["secret", "other"], [], stored)
    assert rules.words == ("other",) and rules.patterns == (r"\d{4}",)
    assert rules.records[word_id].removed_unix_s == NOW and "g-bad" not in rules.records
