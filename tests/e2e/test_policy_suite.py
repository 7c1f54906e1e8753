"""OIDC tokens, guardrails, the audit log and the probes against the real suite (gateway ->
scheduler -> model-pool worker -> transformers engine with `tiny-chat`), through the official
`openai` client. The issuer (an RSA key pair made here, its JWKS) is served on loopback.

How a completion is stopped mid-stream is tested where the chunks can be chosen
(services/gateway/tests/integration/test_policy.py): tiny-chat's words are gibberish."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import jwt
import openai
import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from loadmaster.cli.launcher import Suite, free_port_overrides
from loadmaster.gateway.auth import hash_key

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = ROOT / "examples" / "loadmaster.yaml"
MODEL = "tiny-chat"
AUDIENCE = "loadmaster-e2e"
API_KEY = "lm_e2e-policy-key"
KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def issuer() -> Iterator[str]:
    jwks = {"keys": [{**json.loads(RSAAlgorithm.to_jwk(KEY.public_key())), "kid": "k1", "use": "sig"}]}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            data = json.dumps(jwks).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def suite(issuer: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Suite, Path]]:
    folder = tmp_path_factory.mktemp("policy-suite")
    config = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    config["models"]["repository"] = str(ROOT / "examples" / "models")
    config["model_pool"]["preload"] = [MODEL]
    config["gateway"]["auth"] = {
        "api_keys": [{"name": "e2e-key", "sha256": hash_key(API_KEY)}],
        "oidc": {"issuer": issuer, "audience": [AUDIENCE], "jwks_url": issuer + "/jwks.json"},
    }
    config["gateway"]["guardrails"] = {"blocked_words": ["forbidden"]}
    config["gateway"]["audit"] = {"enabled": True, "path": "audit.jsonl"}  # next to the config
    path = folder / "loadmaster.yaml"
    path.write_text(yaml.safe_dump(config))
    running = Suite(path, overrides=free_port_overrides(), log_dir=folder)
    running.start(timeout_s=120)
    try:
        running.wait_for_models([MODEL], timeout_s=120)
        yield running, folder / "audit.jsonl"
    finally:
        running.stop()


def token(issuer: str, **claims: Any) -> str:
    now = int(time.time())
    body = {"iss": issuer, "aud": AUDIENCE, "sub": "dana", "exp": now + 600, "scope": "loadmaster:infer"}
    return jwt.encode(body | claims, KEY, algorithm="RS256", headers={"kid": "k1"})


def client(suite: Suite, key: str) -> openai.OpenAI:
    gateway = suite.settings.gateway
    url = f"http://{gateway.http_host}:{gateway.http_port}/v1"
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=120)


def audited(path: Path, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        found = [line for line in lines if line["request_id"] == request_id]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no audit line for {request_id}")


def test_a_token_holder_chats_with_tiny_chat_and_is_audited(suite: tuple[Suite, Path], issuer: str) -> None:
    running, audit_path = suite
    messages = [{"role": "user", "content": "hello"}]
    reply = client(running, token(issuer)).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body={"x_priority": 0}
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    line = audited(audit_path, reply.id)
    assert (line["subject"], line["auth"], line["model"], line["priority"], line["outcome"]) == (
        "dana",
        "oidc",
        MODEL,
        0,
        "ok",
    )
    assert (line["prompt_tokens"], line["completion_tokens"]) == (reply.usage.prompt_tokens, 8)
    assert line["prompt_sha256"] == hashlib.sha256(b"hello").hexdigest()
    content = reply.choices[0].message.content or ""
    assert line["completion_sha256"] == hashlib.sha256(content.encode()).hexdigest()
    keyed = client(running, API_KEY).chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert audited(audit_path, keyed.id)["subject"] == "e2e-key"


def test_bad_tokens_and_blocked_prompts_are_refused(suite: tuple[Suite, Path], issuer: str) -> None:
    running, _ = suite
    messages = [{"role": "user", "content": "hello"}]
    with pytest.raises(openai.AuthenticationError, match="expired"):
        client(running, token(issuer, exp=int(time.time()) - 3600)).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2
        )
    with pytest.raises(openai.PermissionDeniedError):
        client(running, token(issuer, scope="openid")).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2
        )
    with pytest.raises(openai.BadRequestError) as raised:
        client(running, API_KEY).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "the Forbidden fruit"}], max_tokens=2
        )
    assert raised.value.code == "policy_refused"


def test_the_probes_name_tiny_chat(suite: tuple[Suite, Path]) -> None:
    gateway = suite[0].settings.gateway
    base = f"http://{gateway.http_host}:{gateway.http_port}"
    for path in ("/readyz", "/healthz", "/livez"):
        assert MODEL in httpx.get(base + path).json()["ready_generative_models"], path
    assert httpx.get(base + "/readyz", params={"model": MODEL}).status_code == 200
