"""Client profiles and cooldowns (gateway/profiles.py): which profile a request gets, what it
fills in, and the cooldown's arithmetic on a fake clock; the config's checks
(libs/common client_config.py)."""

from __future__ import annotations

import json

import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.common.config import ClientsSettings, ConfigError, load_settings
from loadmaster.gateway.frontends.openai_schema import parse_chat, parse_completion
from loadmaster.gateway.profiles import ClientPolicy, CooldownError, Profile, apply_profile

CLIENTS = ClientsSettings.model_validate(
    {
        "profiles": {
            "robot": {"match": {"client_id": "robot-7"}, "priority": 0, "max_tokens": 5},
            "planner-key": {
                "match": {"api_key": "planner"},
                "model": "chat",
                "deadline_ms": 2000,
                "system_prompt": "Answer in one word.",
                "cooldown": {"rate_per_s": 1, "burst": 2, "cooldown_s": 30},
            },
            "lab": {"match": {"tenant": "lab"}, "model": "tiny-chat", "priority": 4},
        },
        "cooldown": {"rate_per_s": 10, "burst": 3},
    }
)


def chat(**fields: object) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def names(policy: ClientPolicy, **who: str) -> str | None:
    profile = policy.profile(**who)  # type: ignore[arg-type]
    return None if profile is None else profile.name


def test_a_profile_is_found_by_client_id_then_api_key_then_tenant() -> None:
    policy = ClientPolicy(lambda: CLIENTS)
    assert names(policy, client_id="robot-7", api_key="planner", tenant="lab") == "robot"
    assert names(policy, client_id="someone", api_key="planner", tenant="lab") == "planner-key"
    assert names(policy, client_id="someone", api_key="other", tenant="lab") == "lab"
    assert names(policy, client_id="someone", api_key="", tenant="") is None
    assert ClientPolicy(ClientsSettings).profile(client_id="robot-7") is None  # no profiles at all


def test_a_profile_fills_only_what_the_request_left_out() -> None:
    profile = Profile("planner-key", CLIENTS.profiles["planner-key"])
    filled = apply_profile(parse_chat(chat()), profile)
    assert filled.model == "chat" and filled.deadline_ms == 2000
    assert tuple((m.role, m.content) for m in filled.messages or ()) == (
        ("system", "Answer in one word."),
        ("user", "hi"),
    )
    assert filled.priority is None and filled.max_tokens is None  # this profile sets neither
    own = apply_profile(
        parse_chat(
            chat(
                model="tiny-chat",
                x_deadline_ms=50,
                messages=[{"role": "system", "content": "Mine."}, {"role": "user", "content": "hi"}],
            )
        ),
        profile,
    )
    assert own.model == "tiny-chat" and own.deadline_ms == 50  # the request's own values win
    assert tuple((m.role, m.content) for m in own.messages or ()) == (
        ("system", "Mine."),
        ("user", "hi"),
    )  # a chat with a system message keeps it
    robot = apply_profile(
        parse_chat(chat(model="m", x_priority=3)), Profile("robot", CLIENTS.profiles["robot"])
    )
    assert (robot.priority, robot.max_tokens) == (3, 5)
    text = apply_profile(parse_completion(b'{"prompt": "once"}'), profile)
    assert text.prompt == "once" and text.messages is None  # no system prompt for a text prompt
    request = parse_chat(chat(model="m"))
    assert apply_profile(request, None) is request


def test_a_cooldown_refuses_above_the_rate_and_says_when_to_come_back() -> None:
    clock = FakeClock()
    policy = ClientPolicy(lambda: CLIENTS, clock=clock)
    for _ in range(3):  # the default cooldown: 10/s in bursts of 3
        policy.charge("anyone", None)
    with pytest.raises(CooldownError) as caught:
        policy.charge("anyone", None)
    assert caught.value.retry_after_s == pytest.approx(0.1)
    assert caught.value.http_status == 429 and "retry after 1 s" in caught.value.message
    policy.charge("someone-else", None)  # per client
    clock.advance(0.1)
    policy.charge("anyone", None)  # one more token has come back
    with pytest.raises(CooldownError):
        policy.charge("anyone", None)


def test_a_profiles_cooldown_holds_the_client_back_for_cooldown_s() -> None:
    clock = FakeClock()
    policy = ClientPolicy(lambda: CLIENTS, clock=clock)
    profile = policy.profile(client_id="k", api_key="planner")
    for _ in range(2):
        policy.charge("k", profile)
    with pytest.raises(CooldownError) as caught:
        policy.charge("k", profile)
    assert caught.value.retry_after_s == pytest.approx(30.0)
    clock.advance(29.0)  # its bucket has refilled, but it is still cooling down
    with pytest.raises(CooldownError) as caught:
        policy.charge("k", profile)
    assert caught.value.retry_after_s == pytest.approx(1.0)
    clock.advance(1.0)
    policy.charge("k", profile)  # refused requests were not charged: it gets through


def test_clients_are_remembered_up_to_a_bound_and_new_settings_apply_at_once() -> None:
    clock = FakeClock()
    current = [CLIENTS.model_copy(update={"max_tracked_clients": 2})]
    policy = ClientPolicy(lambda: current[0], clock=clock)
    for client in ("a", "b", "c"):
        for _ in range(3):
            policy.charge(client, None)
    policy.charge("a", None)  # forgotten (least recently seen of three), so it starts afresh
    current[0] = current[0].model_copy(
        update={"cooldown": CLIENTS.cooldown.model_copy(update={"rate_per_s": 0.0})}
    )
    for _ in range(10):
        policy.charge("b", None)  # cooldown off now: nothing is refused
    current[0] = current[0].model_copy(update={"profiles": {}})
    assert policy.profile(client_id="robot-7") is None  # a replaced settings object is read anew


def test_two_profiles_may_not_match_the_same_client() -> None:
    with pytest.raises(ValueError, match="profiles 'a' and 'b' both match tenant 'lab'"):
        ClientsSettings.model_validate(
            {
                "profiles": {
                    "a": {"match": {"tenant": "lab"}},
                    "b": {"match": {"tenant": "lab"}, "priority": 1},
                }
            }
        )
    with pytest.raises(ValueError, match="exactly one of client_id, api_key, tenant"):
        ClientsSettings.model_validate({"profiles": {"a": {"match": {"tenant": "x", "api_key": "y"}}}})
    with pytest.raises(ConfigError):
        load_settings(None, clients={"cooldown": {"rate_per_s": -1}})
