"""Remote rungs and the cloud-fallback guard through the real suite, with the official `openai`
client. A local OpenAI-compatible server stands in for the hosted API (tests/unit/openai_stub.py,
key required); `cloud-chat` (backend remote_openai) points at it. Two gateways share the suite:
one with `models.allow_cloud_fallback: false` (the guard on), one with it true. The ladders:

    chat3:        [tiny-chat, tiny-chat-b, cloud-chat]   two local rungs, then the cloud
    cloud-first:  [cloud-chat, tiny-chat]                a remote primary

Each test puts the models in the states it needs through the repository API, then checks which
model answered: `model`, `X-Loadmaster-Model`, the text (the stub's words are its own), and what
the stub was sent."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import yaml
from openai_stub import OpenAIStub

from loadmaster.cli.launcher import Suite, free_port_overrides, to_env
from loadmaster.common.child_processes import die_with_parent, signal_group
from loadmaster.common.grpc_client import wait_for_health_sync
from loadmaster.common.ports import free_port
from loadmaster.v1 import metrics_pb2, metrics_pb2_grpc

# Slow (make test-all): a suite with two gateways and a stub cloud, 12 s; test_ladders.py checks
# the rungs' order and the cloud-fallback guard without processes.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = ROOT / "examples" / "loadmaster.yaml"
MODELS_DIR = ROOT / "examples" / "models"
CLOUD = "cloud-chat"
CLOUD_WORDS = "words from the cloud and nowhere else"
KEY = "sk-stub-4f1c"
MESSAGES: Any = [{"role": "user", "content": "which model are you"}]
GENERATIVE = {"max_inflight": 8, "request_ttl_ms": 60000, "dispatch_credits": 0, "lookahead": 0}


@pytest.fixture(scope="module")
def remote() -> Iterator[OpenAIStub]:
    with OpenAIStub(key=KEY, reply=CLOUD_WORDS) as stub:
        yield stub


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory, remote: OpenAIStub) -> Iterator[dict[str, str]]:
    """The suite (its gateway: the guard on) and a second gateway with the guard off; their URLs."""
    folder = tmp_path_factory.mktemp("rungs")
    models = folder / "models"
    models.mkdir()
    for name in ("tiny-chat", "tiny-chat-b"):
        (models / name).symlink_to(MODELS_DIR / name, target_is_directory=True)
    (models / CLOUD).mkdir()
    (models / CLOUD / "api.key").write_text(KEY + "\n")
    (models / CLOUD / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "backend": "remote_openai",
                "base_url": remote.base_url,
                "remote_model": "hosted-model-7b",
                "api_key_file": "api.key",
            }
        )
    )
    config = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    config["models"]["repository"] = str(models)
    config["models"]["known"] = {
        name: GENERATIVE | {"vram_mb": 64} for name in ("tiny-chat", "tiny-chat-b")
    } | {CLOUD: GENERATIVE}
    config["models"]["aliases"] = {
        "chat3": ["tiny-chat", "tiny-chat-b", CLOUD],
        "cloud-first": [CLOUD, "tiny-chat"],
    }
    config["models"]["allow_cloud_fallback"] = False
    config["model_pool"]["preload"] = []
    config["gateway"]["audit"] = {"enabled": True, "path": str(folder / "audit.jsonl")}
    path = folder / "loadmaster.yaml"
    path.write_text(yaml.safe_dump(config))
    suite = Suite(path, overrides=free_port_overrides(), log_dir=folder)
    second: subprocess.Popen[bytes] | None = None
    try:
        suite.start(timeout_s=120)
        ports = {"grpc": free_port(), "http": free_port(), "edge": free_port()}
        env = {
            **suite.env,
            **to_env(
                {
                    "gateway": {
                        "address": f"127.0.0.1:{ports['grpc']}",
                        "http_port": ports["http"],
                        "edge": {"bind": f"tcp://127.0.0.1:{ports['edge']}"},
                        "gr00t": {"bind": f"tcp://127.0.0.1:{free_port()}"},  # (the suite's is taken)
                        "audit": {"path": str(folder / "audit-open.jsonl")},
                    },
                    "models": {"allow_cloud_fallback": "true"},
                }
            ),
        }
        with (folder / "gateway-open.log").open("ab") as log:
            second = subprocess.Popen(
                die_with_parent([sys.executable, "-m", "loadmaster.gateway", "--config", str(path)]),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for_health_sync(f"127.0.0.1:{ports['grpc']}", timeout_s=90)
        gateway = suite.settings.gateway
        yield {
            "guarded": f"http://{gateway.http_host}:{gateway.http_port}",
            "open": f"http://127.0.0.1:{ports['http']}",
            "audit": str(folder / "audit.jsonl"),
            "metrics": suite.settings.metrics.address,
        }
    finally:
        if second is not None:
            signal_group(second, 15)
            try:
                second.wait(30)
            except subprocess.TimeoutExpired:
                signal_group(second, 9)
                second.wait(10)
        suite.stop()
        for log in sorted(folder.glob("*.log")):
            print(f"---- {log.name} (tail) ----\n" + "\n".join(log.read_text().splitlines()[-30:]))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def listed(url: str) -> dict[str, str]:
    return {m.id: (m.model_extra or {})["x_state"] for m in client(url).models.list()}


def put(gateways: dict[str, str], **wanted: str) -> None:
    """Load (READY) or unload (IDLE) each model, then wait until both gateways see it (each
    `/v1/models` is a fresh look, which their ladders route the next request by)."""
    for model, state in wanted.items():
        action = "load" if state == "READY" else "unload"
        reply = httpx.post(f"{gateways['guarded']}/v2/repository/models/{model}/{action}", timeout=120)
        assert reply.status_code == 200, reply.text
    deadline = time.monotonic() + 30
    for url in (gateways["guarded"], gateways["open"]):
        while True:  # bounded: the scheduler hears of a state at once
            states = listed(url)
            if all(
                (states.get(m) == s) if s == "READY" else states.get(m) != "READY" for m, s in wanted.items()
            ):
                break
            assert time.monotonic() < deadline, f"models not in {wanted} within 30 s: {states}"
            time.sleep(0.05)


def answer(url: str, model: str, **extra: Any) -> tuple[str, str, str]:
    """(`model`, X-Loadmaster-Model, text) of a greedy chat completion."""
    raw = client(url).chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=12, temperature=0, **extra
    )
    reply = raw.parse()
    return reply.model, raw.headers["x-loadmaster-model"], reply.choices[0].message.content or ""


def test_a_warm_remote_rung_answers_when_allowed_and_is_skipped_when_not(
    gateways: dict[str, str], remote: OpenAIStub
) -> None:
    put(gateways, **{CLOUD: "READY", "tiny-chat": "IDLE", "tiny-chat-b": "IDLE"})
    sent = len(remote.requests)
    model, header, text = answer(gateways["open"], "chat3")  # the guard off: the cloud answers
    assert (model, header) == (CLOUD, CLOUD) and text.split() == CLOUD_WORDS.split()[:12]
    asked = remote.requests[sent]
    assert asked["model"] == "hosted-model-7b" and asked["authorization"] == f"Bearer {KEY}"
    assert asked["messages"] == MESSAGES and asked["stream"] is True  # the worker always streams

    stream = client(gateways["open"]).chat.completions.create(
        model="chat3", messages=MESSAGES, max_tokens=3, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert {c.model for c in chunks} == {CLOUD}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "words from the "
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3

    sent = len(remote.requests)
    model, header, _ = answer(gateways["guarded"], "chat3")  # the guard on: the cold primary loads
    assert (model, header) == ("tiny-chat", "tiny-chat")
    assert len(remote.requests) == sent  # the cloud was never asked


def test_a_remote_primary_and_a_request_naming_the_remote_model_are_always_served(
    gateways: dict[str, str], remote: OpenAIStub
) -> None:
    put(gateways, **{CLOUD: "READY"})
    for model in ("cloud-first", CLOUD):
        assert answer(gateways["guarded"], model)[:2] == (CLOUD, CLOUD)
    deadline = time.monotonic() + 10
    while True:  # bounded: the audit writer is a thread of its own
        lines = [json.loads(line) for line in Path(gateways["audit"]).read_text().splitlines()]
        cloud = [line for line in lines if line["model"] == CLOUD and line["outcome"] == "ok"]
        if len(cloud) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(cloud) >= 2 and all(line["completion_tokens"] > 0 for line in cloud)  # audited as any
    with grpc.insecure_channel(gateways["metrics"]) as channel:
        stub = metrics_pb2_grpc.MetricsServiceStub(channel)
        for _ in range(50):  # bounded: reporters flush every 250 ms
            request = metrics_pb2.GetStatsRequest(name="output_tokens", labels={"model": CLOUD})
            if stub.GetStats(request, timeout=5).stats.sum > 0:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("no output_tokens of the remote model reached the metrics service")


def test_with_the_guard_on_a_warm_local_fallback_still_answers(gateways: dict[str, str]) -> None:
    put(gateways, **{CLOUD: "READY", "tiny-chat-b": "READY", "tiny-chat": "IDLE"})
    assert answer(gateways["guarded"], "chat3")[:2] == ("tiny-chat-b", "tiny-chat-b")
    assert answer(gateways["open"], "chat3")[:2] == ("tiny-chat-b", "tiny-chat-b")  # in the ladder's order
