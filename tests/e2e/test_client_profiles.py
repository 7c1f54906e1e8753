"""Client profiles and cooldowns over HTTP, through the real suite with the official `openai`
client. API keys are on: `alpha` (its own profile), `gamma` (tenant `lab`, whose profile it
gets) and `beta` (no profile). Profiles:

    alpha-key  api_key alpha:      model tiny-chat, max_tokens 3, a system prompt
    lab        tenant lab:         model tiny-chat, priority 0
    robot      client_id robot-7:  model tiny-chat, cooldown 2 requests, then 30 s
    hurried    client_id hurried:  model tiny-chat, deadline 50 ms

What a profile filled in is seen in the answer (`model`, token counts: the system prompt's
tokens are in `usage.prompt_tokens`), in the audit log (priority), and in a 504 (the deadline).
tiny-chat is not preloaded: the first test finds it cold."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from loadmaster.cli.launcher import Suite, free_port_overrides

# Slow (make test-all): a suite of its own, 9 s; services/gateway/tests/unit/test_profiles.py
# checks how a profile is found, what it fills in, and the cooldown.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = ROOT / "examples" / "loadmaster.yaml"
KEYS = {"alpha": "lm_alpha-key-1", "beta": "lm_beta-key-2", "gamma": "lm_gamma-key-3"}
SYSTEM = "Answer in one word."
MESSAGES: Any = [{"role": "user", "content": "what is the tide"}]


@pytest.fixture(scope="module")
def suite_with_profiles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    folder = tmp_path_factory.mktemp("profiles")
    config = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    config["models"]["repository"] = str(ROOT / "examples" / "models")
    config["model_pool"]["preload"] = []
    config["gateway"]["auth"] = {
        "api_keys": [
            {"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest()}
            | ({"tenant": "lab"} if name == "gamma" else {})
            for name, key in KEYS.items()
        ]
    }
    config["gateway"]["audit"] = {"enabled": True, "path": str(folder / "audit.jsonl")}
    config["clients"]["profiles"] = {
        "alpha-key": {
            "match": {"api_key": "alpha"},
            "model": "tiny-chat",
            "max_tokens": 3,
            "system_prompt": SYSTEM,
        },
        "lab": {"match": {"tenant": "lab"}, "model": "tiny-chat", "priority": 0},
        "robot": {
            "match": {"client_id": "robot-7"},
            "model": "tiny-chat",
            "cooldown": {"rate_per_s": 0.1, "burst": 2, "cooldown_s": 30},
        },
        "hurried": {"match": {"client_id": "hurried"}, "model": "tiny-chat", "deadline_ms": 50},
    }
    path = folder / "loadmaster.yaml"
    path.write_text(yaml.safe_dump(config))
    suite = Suite(path, overrides=free_port_overrides(), log_dir=folder)
    suite.start(timeout_s=120)
    try:
        gateway = suite.settings.gateway
        yield f"http://{gateway.http_host}:{gateway.http_port}/v1", folder / "audit.jsonl"
    finally:
        suite.stop()
        for log in sorted(folder.glob("*.log")):
            print(f"---- {log.name} (tail) ----\n" + "\n".join(log.read_text().splitlines()[-30:]))


@pytest.fixture(scope="module")
def url(suite_with_profiles: tuple[str, Path]) -> str:
    return suite_with_profiles[0]


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=KEYS[key], max_retries=0, timeout=120)


def chat(url: str, key: str, **fields: Any) -> Any:
    fields.setdefault("model", "")  # "": the profile's model
    fields.setdefault("messages", MESSAGES)
    extra = {name: fields.pop(name) for name in list(fields) if name.startswith("x_")}
    return client(url, key).chat.completions.create(temperature=0, extra_body=extra or None, **fields)


def audit_lines(path: Path, wanted: Callable[[list[dict[str, Any]]], bool]) -> list[dict[str, Any]]:
    """The audit log's lines once `wanted(lines)` holds (the file is shared by the module's
    tests, and the writer is a thread of its own), or as they are after 10 s."""
    deadline = time.monotonic() + 10
    while True:  # bounded
        lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        if wanted(lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def _from(*client_ids: str) -> Callable[[list[dict[str, Any]]], bool]:
    return lambda lines: set(client_ids) <= {line["client_id"] for line in lines}


def test_a_profiles_deadline_applies_and_the_request_may_give_its_own(url: str) -> None:
    with pytest.raises(openai.APIStatusError) as caught:  # tiny-chat is cold: 50 ms is not enough
        chat(url, "beta", x_client_id="hurried", max_tokens=2)
    assert caught.value.status_code == 504
    reply = chat(url, "beta", x_client_id="hurried", max_tokens=2, x_deadline_ms=60_000)  # waits for the load
    assert reply.model == "tiny-chat" and reply.usage.completion_tokens == 2


def test_an_api_key_profile_fills_the_model_max_tokens_and_system_prompt(url: str) -> None:
    filled = chat(url, "alpha")
    assert filled.model == "tiny-chat" and filled.usage.completion_tokens == 3
    by_hand = chat(
        url,
        "beta",
        model="tiny-chat",
        max_tokens=3,
        messages=[{"role": "system", "content": SYSTEM}, *MESSAGES],
    )
    assert filled.usage.prompt_tokens == by_hand.usage.prompt_tokens  # the system prompt was put first
    assert filled.choices[0].message.content == by_hand.choices[0].message.content
    plain = chat(url, "beta", model="tiny-chat", max_tokens=3)
    assert plain.usage.prompt_tokens < filled.usage.prompt_tokens
    own = chat(url, "alpha", max_tokens=5, messages=[{"role": "system", "content": "x"}, *MESSAGES])
    assert own.usage.completion_tokens == 5  # the request's own values win
    assert own.usage.prompt_tokens < filled.usage.prompt_tokens  # its own system message stays alone
    with pytest.raises(openai.BadRequestError) as caught:  # no profile names a model for beta
        chat(url, "beta")
    assert caught.value.param == "model"


def test_a_tenant_profile_sets_the_priority(suite_with_profiles: tuple[str, Path]) -> None:
    url, audit = suite_with_profiles
    chat(url, "gamma", max_tokens=1, x_client_id="lab-runner")
    chat(url, "beta", model="tiny-chat", max_tokens=1, x_client_id="plain-runner")
    lines = audit_lines(audit, _from("lab-runner", "plain-runner"))
    priorities = {line["client_id"]: line["priority"] for line in lines if line["outcome"] == "ok"}
    assert priorities["lab-runner"] == 0 and priorities["plain-runner"] == 1  # 1: the default
    assert {line["model"] for line in lines if line["client_id"] == "lab-runner"} == {"tiny-chat"}


def test_a_cooldown_refuses_a_flooding_client_with_429_and_retry_after(
    suite_with_profiles: tuple[str, Path],
) -> None:
    url, audit = suite_with_profiles
    for _ in range(2):
        assert chat(url, "beta", x_client_id="robot-7", max_tokens=1).model == "tiny-chat"
    with pytest.raises(openai.RateLimitError) as caught:
        chat(url, "beta", x_client_id="robot-7", max_tokens=1)
    assert caught.value.response.headers["retry-after"] == "30"
    assert "client 'robot-7'" in caught.value.message and "retry after 30 s" in caught.value.message
    with pytest.raises(openai.RateLimitError):  # still cooling down
        chat(url, "beta", x_client_id="robot-7", max_tokens=1)
    assert chat(url, "beta", x_client_id="robot-8", model="tiny-chat", max_tokens=1).choices  # others pass

    def robot_7_refused(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [line for line in lines if line["client_id"] == "robot-7" and line["status"] == 429]

    refused = robot_7_refused(audit_lines(audit, lambda lines: bool(robot_7_refused(lines))))
    assert len(refused) >= 1 and refused[0]["outcome"] == "resource_exhausted"
