"""Model ladders through the real suite with the official `openai` client: two tiny LLMs
(`tiny-chat` and `tiny-chat-b`, the same shape with other weights, so each answers its own
text) behind the aliases

    chat:    [tiny-chat-b, tiny-chat]                      the primary when warm, else a warm fallback
    chat-b:  [tiny-chat-b, tiny-chat], pin_primary: true   always the primary, cold or not

Each test puts the models in the states it needs through the gateway's repository API
(load / unload), then asks the alias and checks which model answered: in `model`, in every
stream chunk, in `X-Loadmaster-Model`, and by its text (greedy decoding, so the answer of a
model is reproducible)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from loadmaster.cli.launcher import Suite, free_port_overrides

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = ROOT / "examples" / "loadmaster.yaml"
MODELS_DIR = ROOT / "examples" / "models"
PRIMARY, FALLBACK = "tiny-chat-b", "tiny-chat"
MESSAGES: list[dict[str, str]] = [{"role": "user", "content": "which model are you"}]


@pytest.fixture(scope="module")
def ladder_suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    """The example suite with no model preloaded and two ladders over the two tiny LLMs."""
    folder = tmp_path_factory.mktemp("ladders")
    config = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    config["models"]["repository"] = str(MODELS_DIR)
    config["models"]["aliases"] = {
        "chat": {"models": [PRIMARY, FALLBACK]},
        "chat-b": {"models": [PRIMARY, FALLBACK], "pin_primary": True},
    }
    config["model_pool"]["preload"] = []
    path = folder / "loadmaster.yaml"
    path.write_text(yaml.safe_dump(config))
    running = Suite(path, overrides=free_port_overrides(), log_dir=folder)
    running.start(timeout_s=120)
    try:
        yield running
    finally:
        running.stop()
        for log in sorted(folder.glob("*.log")):
            print(f"---- {log.name} (tail) ----\n" + "\n".join(log.read_text().splitlines()[-30:]))


@pytest.fixture(scope="module")
def base_url(ladder_suite: Suite) -> str:
    gateway = ladder_suite.settings.gateway
    return f"http://{gateway.http_host}:{gateway.http_port}"


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def listed(client: openai.OpenAI) -> dict[str, str]:
    return {m.id: (m.model_extra or {})["x_state"] for m in client.models.list()}


COLD = ("IDLE", "UNAVAILABLE")  # not loaded: never, or unloaded (the state then says why)


def cold(state: str | None) -> bool:
    return state in COLD


def put(base_url: str, client: openai.OpenAI, **wanted: str) -> None:
    """Load (READY) or unload (IDLE) each model, then wait until `/v1/models` shows it: that
    fresh look is also what the gateway's ladders route the next request by."""
    for model, state in wanted.items():
        action = "load" if state == "READY" else "unload"
        reply = httpx.post(f"{base_url}/v2/repository/models/{model}/{action}", timeout=120)
        assert reply.status_code == 200, reply.text
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # bounded: the scheduler hears of a state at once
        states = listed(client)
        if all(
            states.get(model) == state or (state == "IDLE" and cold(states.get(model)))
            for model, state in wanted.items()
        ):
            return
        time.sleep(0.05)
    raise AssertionError(f"models not in {wanted} within 30 s: {listed(client)}")


def answer(client: openai.OpenAI, model: str) -> tuple[str, str, str]:
    """(the `model` field, the X-Loadmaster-Model header, the text) of a greedy chat completion."""
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=12, temperature=0
    )
    reply = raw.parse()
    return reply.model, raw.headers["x-loadmaster-model"], reply.choices[0].message.content or ""


def test_the_aliases_are_listed_with_the_models(client: openai.OpenAI) -> None:
    states = listed(client)
    assert {"chat", "chat-b", PRIMARY, FALLBACK} <= states.keys()
    assert client.models.retrieve("chat").id == "chat"


def test_a_warm_fallback_answers_while_the_primary_is_cold(base_url: str, client: openai.OpenAI) -> None:
    put(base_url, client, **{FALLBACK: "READY", PRIMARY: "IDLE"})
    own = answer(client, FALLBACK)
    assert answer(client, "chat") == (FALLBACK, FALLBACK, own[2])
    assert cold(listed(client)[PRIMARY])  # the alias did not load its cold primary


def test_a_pinned_alias_loads_its_cold_primary(base_url: str, client: openai.OpenAI) -> None:
    put(base_url, client, **{FALLBACK: "READY", PRIMARY: "IDLE"})
    model, header, text = answer(client, "chat-b")
    assert (model, header) == (PRIMARY, PRIMARY)
    assert text == answer(client, PRIMARY)[2]
    assert text != answer(client, FALLBACK)[2]  # other weights, other words: it really was the primary


def test_the_warm_primary_streams_every_chunk_under_its_name(base_url: str, client: openai.OpenAI) -> None:
    put(base_url, client, **{FALLBACK: "READY", PRIMARY: "READY"})
    raw = client.chat.completions.with_raw_response.create(
        model="chat", messages=MESSAGES, max_tokens=12, temperature=0, stream=True
    )
    header = raw.headers["x-loadmaster-model"]
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert header == PRIMARY and {c.model for c in chunks} == {PRIMARY}
    assert text == answer(client, PRIMARY)[2]


def test_with_no_model_warm_the_alias_loads_its_primary(base_url: str, client: openai.OpenAI) -> None:
    put(base_url, client, **{FALLBACK: "IDLE", PRIMARY: "IDLE"})
    model, header, _ = answer(client, "chat")
    assert (model, header) == (PRIMARY, PRIMARY)
    assert cold(listed(client)[FALLBACK])
