"""OIDC tokens, guardrails, the audit log and per-model readiness, through a real gateway process
(`python -m loadmaster.gateway`) with the `openai` client and raw HTTP.

Behind the gateway, on loopback:

- `IdentityProvider`: an OIDC issuer made by the test (its own RSA and EC key pairs), serving
  its discovery document and JWKS over HTTP, and a policy webhook, counting what it is asked;
- `Backend`: the real scheduler in-process, and a scripted generative worker: a real
  `WorkerSession` registering `tiny-chat` (backend `transformers`) READY, and a ZMQ ROUTER data
  port that answers each `GenerateRequest` with the chunks its last message spells
  (`"say:for|bidden| text"` -> `"for"`, `"bidden"`, `" text"`), then `stop`.

Both run on threads of their own, so the tests drive the gateway with the blocking `openai`
client. The scripted worker also serves the drain case at the end: a stream still running when
its gateway gets SIGTERM."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jwt
import ollama
import openai
import pytest
import tritonclient.grpc as triton_grpc
import zmq
import zmq.asyncio
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm
from tritonclient.utils import InferenceServerException

from loadmaster.common.config import load_settings
from loadmaster.common.framing import GENERATE_CANCEL_FRAME, GENERATE_REPLIES_FRAME, GENERATE_REQUEST_FRAME
from loadmaster.common.grpc_client import aio_channel
from loadmaster.common.ports import free_port
from loadmaster.gateway.auth import hash_key
from loadmaster.scheduler.server import build
from loadmaster.v1 import model_pool_pb2, scheduler_pb2, scheduler_pb2_grpc

MODEL = "tiny-chat"
AUDIENCE = "loadmaster-gateway"
WORKER_ID = "scripted-worker"


@dataclass(slots=True)
class SigningKey:
    kid: str
    alg: str
    private: Any

    def jwk(self) -> dict[str, Any]:
        algorithm = RSAAlgorithm if self.alg == "RS256" else ECAlgorithm
        key = json.loads(algorithm.to_jwk(self.private.public_key()))
        return {**key, "kid": self.kid, "alg": self.alg, "use": "sig"}


def rsa_key(kid: str) -> SigningKey:
    return SigningKey(kid, "RS256", rsa.generate_private_key(public_exponent=65537, key_size=2048))


def ec_key(kid: str) -> SigningKey:
    return SigningKey(kid, "ES256", ec.generate_private_key(ec.SECP256R1()))


@dataclass(slots=True)
class IdentityProvider:
    """Issuer, JWKS and policy webhook on one loopback HTTP server."""

    published: list[SigningKey]
    jwks_fetches: int = 0
    webhook_calls: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0
    _server: ThreadingHTTPServer | None = None

    @property
    def issuer(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def token(self, key: SigningKey, **claims: Any) -> str:
        now = int(time.time())
        body = {"iss": self.issuer, "aud": AUDIENCE, "sub": "alice", "scope": "openid loadmaster:infer"}
        body |= {"iat": now, "exp": now + 300}
        body |= claims
        return jwt.encode(
            {k: v for k, v in body.items() if v is not None},
            key.private,
            algorithm=key.alg,
            headers={"kid": key.kid},
        )

    def start(self) -> None:
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, body: Any, status: int = 200) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/.well-known/openid-configuration":
                    self._json({"issuer": provider.issuer, "jwks_uri": provider.issuer + "/jwks.json"})
                elif self.path == "/jwks.json":
                    provider.jwks_fetches += 1
                    self._json({"keys": [key.jwk() for key in provider.published]})
                else:
                    self._json({"error": "not found"}, 404)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                provider.webhook_calls.append(body)
                if body["client_id"] == "banned":
                    self._json({"allow": False, "reason": "this client is banned"})
                elif body["client_id"] == "slow":
                    time.sleep(1.0)  # past the gateway's webhook timeout
                    self._json({"allow": True})
                else:
                    self._json({"result": {"allow": True}})  # OPA's shape

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class Backend:
    """The real scheduler and a scripted generative worker, on a loop in a thread."""

    def __init__(self) -> None:
        self.scheduler_address = ""
        self.data_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.generated: list[model_pool_pb2.GenerateRequest] = []
        self.cancelled: list[str] = []
        self._answering: set[asyncio.Task[None]] = set()
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        settings = load_settings(None, scheduler={"address": "127.0.0.1:0"}, metrics={"enabled": False})
        self._scheduler = build(settings)
        port = await self._scheduler.start()
        self.scheduler_address = f"127.0.0.1:{port}"
        self._context = zmq.asyncio.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.bind(self.data_endpoint)
        self._stop = asyncio.Event()
        self._serving = asyncio.ensure_future(self._serve())
        self._channel = aio_channel(self.scheduler_address)
        self._session = scheduler_pb2_grpc.SchedulerServiceStub(self._channel).WorkerSession()
        hello = scheduler_pb2.WorkerHello(
            worker_id=WORKER_ID, data_endpoint=self.data_endpoint, repository=[MODEL, "double"]
        )
        await self._session.write(scheduler_pb2.WorkerSessionRequest(hello=hello))
        slots = [
            model_pool_pb2.ModelSlotStatus(
                model_id=MODEL,
                state=model_pool_pb2.MODEL_STATE_READY,
                generation=1,
                backend="transformers",
                max_inflight=8,
            ),
            model_pool_pb2.ModelSlotStatus(
                model_id="double",
                state=model_pool_pb2.MODEL_STATE_READY,
                generation=1,
                backend="python",
                max_inflight=2,
            ),
        ]
        await self._session.write(
            scheduler_pb2.WorkerSessionRequest(report=scheduler_pb2.WorkerReport(models=slots))
        )

    async def _serve(self) -> None:
        assert self._stop is not None
        while not self._stop.is_set():
            identity, kind, body = await self._router.recv_multipart()
            if kind == GENERATE_CANCEL_FRAME:
                self.cancelled.append(model_pool_pb2.CancelGeneration.FromString(body).request_id)
                continue
            assert kind == GENERATE_REQUEST_FRAME
            request = model_pool_pb2.GenerateRequest.FromString(body)
            self.generated.append(request)
            task = asyncio.ensure_future(self._answer(identity, request))
            self._answering.add(task)
            task.add_done_callback(self._answering.discard)

    async def _answer(self, identity: bytes, request: model_pool_pb2.GenerateRequest) -> None:
        said = request.messages.messages[-1].content if request.HasField("messages") else request.prompt_text
        pieces = said.removeprefix("say:").split("|") if said.startswith("say:") else ["fine"]

        def reply(sequence: int, **kind: Any) -> model_pool_pb2.GenerateReply:
            return model_pool_pb2.GenerateReply(
                request_id=request.request_id,
                model_id=request.model_id,
                sequence=sequence,
                worker_id=WORKER_ID,
                generation=request.generation,
                **kind,
            )

        for sequence, piece in enumerate(pieces):  # one message each: chunks arrive apart
            chunk = reply(sequence, chunk=model_pool_pb2.TokenChunk(token_ids=[sequence], text=piece))
            await self._send(identity, [chunk])
            await asyncio.sleep(0.01)
            if request.request_id in self.cancelled:
                await self._send(
                    identity, [reply(sequence + 1, cancelled=model_pool_pb2.GenerationCancelled())]
                )
                return
        usage = model_pool_pb2.GenerationUsage(prompt_tokens=7, completion_tokens=len(pieces))
        result = model_pool_pb2.GenerationResult(finish_reason=model_pool_pb2.FINISH_REASON_STOP, usage=usage)
        await self._send(identity, [reply(len(pieces), result=result)])

    async def _send(self, identity: bytes, replies: list[model_pool_pb2.GenerateReply]) -> None:
        message = model_pool_pb2.GenerateReplies(replies=replies)
        await self._router.send_multipart([identity, GENERATE_REPLIES_FRAME, message.SerializeToString()])

    async def _shutdown(self) -> None:
        self._serving.cancel()
        self._session.cancel()
        await self._channel.close()
        await self._scheduler.stop()
        self._router.close(0)
        self._context.term()


def eventually(check: Callable[[], bool], *, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def provider() -> Iterator[IdentityProvider]:
    provider = IdentityProvider([rsa_key("rsa-1"), ec_key("ec-1")])
    provider.start()
    yield provider
    provider.stop()


@pytest.fixture(scope="module")
def backend() -> Iterator[Backend]:
    backend = Backend()
    backend.start()
    yield backend
    backend.stop()


API_KEY = "lm_policy-test-key"
PROFILED = "profiled-client"  # the client id a client profile matches (clients.profiles)
PROFILE_SYSTEM = "Answer as the profile says."
SAID_FORBIDDEN = "say:safe text |for|bidden| more"  # the blocked word arrives split in two chunks


@dataclass(frozen=True, slots=True)
class Gateway:
    http_url: str
    grpc_address: str
    audit_path: Path

    def client(self, token: str, **options: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.http_url + "/v1", api_key=token, max_retries=0, timeout=30, **options
        )

    def audit_lines(self) -> list[dict[str, Any]]:
        if not self.audit_path.exists():
            return []
        return [json.loads(line) for line in self.audit_path.read_text().splitlines()]

    def audited(self, request_id: str) -> dict[str, Any]:
        found: list[dict[str, Any]] = []

        def written() -> bool:
            found[:] = [line for line in self.audit_lines() if line["request_id"] == request_id]
            return bool(found)

        eventually(written)
        [line] = found
        return line


def start_policy_gateway(
    start_gateway: Callable[..., Any],
    provider: IdentityProvider,
    backend: Backend,
    folder: Path,
    *,
    fail_open: bool = False,
) -> Gateway:
    audit_path = folder / ("audit-open.jsonl" if fail_open else "audit.jsonl")
    config = {
        "auth": {
            "api_keys": [{"name": "ops-key", "sha256": hash_key(API_KEY), "scopes": ["infer"]}],
            "oidc": {
                "issuer": provider.issuer,
                "audience": [AUDIENCE],
                "jwks_refetch_interval_s": 0,  # every unknown kid refetches (unit tests cover the limit)
                "rate_per_s": 0.001,
                "burst": 20,
            },
        },
        "guardrails": {
            "blocked_words": ["forbidden", "top secret"],
            "blocked_patterns": [r"\bkey-\d{4}\b"],
            "stream_holdback_chars": 12,
            "webhook": {"url": provider.issuer + "/policy", "timeout_ms": 300, "fail_open": fail_open},
        },
        "audit": {"enabled": True, "path": str(audit_path)},
    }
    profiles = {
        "profiled": {
            "match": {"client_id": PROFILED},
            "priority": 3,
            "max_tokens": 5,
            "system_prompt": PROFILE_SYSTEM,
        }
    }
    process = start_gateway(
        config,
        scheduler_address=backend.scheduler_address,
        top_level={"clients": {"profiles": profiles}},
    )
    gateway = Gateway(process.http_url, process.grpc_address, audit_path)
    eventually(lambda: httpx.get(gateway.http_url + "/readyz").status_code == 200, timeout_s=20)
    return gateway


@pytest.fixture(scope="module")
def gateway(
    start_gateway: Callable[..., Any],
    provider: IdentityProvider,
    backend: Backend,
    tmp_path_factory: pytest.TempPathFactory,
) -> Gateway:
    return start_policy_gateway(start_gateway, provider, backend, tmp_path_factory.mktemp("policy"))


def chat(client: openai.OpenAI, text: str, **options: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], **options
    )


# ---- OIDC -----------------------------------------------------------------------------------


def test_a_good_rs256_or_es256_token_is_served_and_names_its_subject(
    gateway: Gateway, provider: IdentityProvider
) -> None:
    rsa_token = provider.token(provider.published[0], sub="alice")
    assert [m.id for m in gateway.client(rsa_token).models.list()] == [MODEL]
    ec_token = provider.token(provider.published[1], sub="erin")
    reply = chat(gateway.client(ec_token), "say:hello| there", extra_body={"x_priority": 0})
    assert reply.choices[0].message.content == "hello there"
    line = gateway.audited(reply.id)
    assert (line["subject"], line["auth"], line["client_id"], line["priority"]) == ("erin", "oidc", "erin", 0)


def test_api_keys_keep_working_beside_tokens(gateway: Gateway) -> None:
    reply = chat(gateway.client(API_KEY), "say:keyed")
    assert reply.choices[0].message.content == "keyed"
    index = httpx.post(
        gateway.http_url + "/v2/repository/index", headers={"authorization": f"Bearer {API_KEY}"}
    )
    assert index.status_code == 200 and {m["name"] for m in index.json()} == {MODEL, "double"}
    with pytest.raises(openai.AuthenticationError, match="API key is not valid"):
        gateway.client("lm_not-a-key").models.list()


def test_tokens_work_on_kserve_http_and_grpc_too(gateway: Gateway, provider: IdentityProvider) -> None:
    token = provider.token(provider.published[0], sub="kserve-user")
    http = httpx.post(gateway.http_url + "/v2/repository/index", headers={"authorization": f"Bearer {token}"})
    assert http.status_code == 200 and MODEL in {m["name"] for m in http.json()}
    client = triton_grpc.InferenceServerClient(gateway.grpc_address)
    try:
        index = client.get_model_repository_index(headers={"authorization": f"Bearer {token}"}, as_json=True)
        assert MODEL in {m["name"] for m in index["models"]}
        expired = provider.token(provider.published[0], exp=int(time.time()) - 3600)
        with pytest.raises(InferenceServerException) as raised:
            client.get_model_repository_index(headers={"authorization": f"Bearer {expired}"})
        assert raised.value.status() == "StatusCode.UNAUTHENTICATED" and "expired" in raised.value.message()
        with pytest.raises(InferenceServerException) as raised:
            client.load_model(MODEL, headers={"authorization": f"Bearer {token}"})  # infer scope only
        assert raised.value.status() == "StatusCode.PERMISSION_DENIED"
    finally:
        client.close()


@pytest.mark.parametrize(
    ("claims", "message"),
    [
        ({"exp": int(time.time()) - 3600}, "expired"),
        ({"aud": "another-service"}, "not meant for this service"),
        ({"iss": "http://127.0.0.1:1"}, "another issuer"),
        ({"nbf": int(time.time()) + 3600}, "not valid yet"),
        ({"exp": None}, "lacks the 'exp' claim"),
    ],
)
def test_a_token_with_bad_claims_is_refused(
    gateway: Gateway, provider: IdentityProvider, claims: dict[str, Any], message: str
) -> None:
    token = provider.token(provider.published[0], **claims)
    with pytest.raises(openai.AuthenticationError, match=message) as raised:
        chat(gateway.client(token), "say:hi")
    assert raised.value.status_code == 401


def test_a_token_signed_by_another_key_is_refused(gateway: Gateway, provider: IdentityProvider) -> None:
    impostor = rsa_key("rsa-1")  # claims the issuer's kid, signs with its own key
    with pytest.raises(openai.AuthenticationError, match="signature does not verify"):
        gateway.client(provider.token(impostor)).models.list()
    unknown = rsa_key("nobody")
    with pytest.raises(openai.AuthenticationError, match="'nobody' is not in the issuer's key set"):
        gateway.client(provider.token(unknown)).models.list()
    forged = jwt.encode(
        {"iss": provider.issuer, "aud": AUDIENCE, "sub": "eve"}, "s" * 32, headers={"kid": "rsa-1"}
    )
    with pytest.raises(openai.AuthenticationError, match="algorithm 'HS256' is not accepted"):
        gateway.client(forged).models.list()


def test_a_rotated_key_is_fetched_when_a_token_names_it(gateway: Gateway, provider: IdentityProvider) -> None:
    gateway.client(provider.token(provider.published[0])).models.list()  # the set is cached
    before = provider.jwks_fetches
    gateway.client(provider.token(provider.published[0])).models.list()
    assert provider.jwks_fetches == before  # a known kid: no fetch
    rotated = rsa_key("rsa-2")
    provider.published.append(rotated)
    try:
        assert [m.id for m in gateway.client(provider.token(rotated, sub="rota")).models.list()] == [MODEL]
        assert provider.jwks_fetches == before + 1
    finally:
        provider.published.remove(rotated)


def test_a_token_without_the_scope_is_forbidden(gateway: Gateway, provider: IdentityProvider) -> None:
    token = provider.token(provider.published[0], sub="reader", scope="openid profile")
    with pytest.raises(openai.PermissionDeniedError, match="lacks the 'infer' scope"):
        chat(gateway.client(token), "say:hi")
    admin_only = provider.token(provider.published[0], sub="root", scope="loadmaster:admin")
    with pytest.raises(openai.PermissionDeniedError):
        gateway.client(admin_only).models.list()


def test_each_subject_has_its_own_rate_limit(gateway: Gateway, provider: IdentityProvider) -> None:
    bursty = gateway.client(provider.token(provider.published[0], sub="bursty"))
    for _ in range(20):  # the burst
        bursty.models.list()
    with pytest.raises(openai.RateLimitError, match="subject 'bursty' exceeded its rate limit"):
        bursty.models.list()
    calm = gateway.client(provider.token(provider.published[0], sub="calm"))
    assert [m.id for m in calm.models.list()] == [MODEL]


# ---- guardrails -----------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["this is FORBIDDEN stuff", "say top secret now", "use key-1234 please"])
def test_a_prompt_on_the_blocklist_is_refused_by_policy(
    gateway: Gateway, backend: Backend, prompt: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        chat(gateway.client(API_KEY), prompt)
    assert raised.value.status_code == 400 and raised.value.code == "policy_refused"
    assert "refused by policy" in raised.value.message
    assert not any(r.messages.messages[-1].content == prompt for r in backend.generated)


def test_words_match_whole_words_only(gateway: Gateway) -> None:
    reply = chat(gateway.client(API_KEY), "say:unforbiddenly| fine| key-12345")
    assert reply.choices[0].message.content == "unforbiddenly fine key-12345"
    assert reply.choices[0].finish_reason == "stop"


def test_a_streamed_completion_stops_before_a_blocked_word_split_across_chunks(
    gateway: Gateway, backend: Backend
) -> None:
    stream = chat(
        gateway.client(API_KEY), SAID_FORBIDDEN, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "safe text "  # nothing of "for" + "bidden" went out
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["content_filter"]
    request_id = chunks[0].id
    eventually(lambda: request_id in backend.cancelled)  # the generation was stopped at the worker
    line = gateway.audited(request_id)
    assert (line["outcome"], line["finish_reason"], line["stream"]) == (
        "content_filter",
        "content_filter",
        True,
    )
    assert line["completion_sha256"] == hashlib.sha256(b"safe text ").hexdigest()


def test_a_whole_completion_with_a_blocked_word_ends_with_content_filter(gateway: Gateway) -> None:
    reply = chat(gateway.client(API_KEY), SAID_FORBIDDEN)
    assert reply.choices[0].finish_reason == "content_filter"
    assert reply.choices[0].message.content == "safe text "


def test_the_policy_webhook_sees_metadata_and_can_refuse(
    gateway: Gateway, provider: IdentityProvider
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        chat(gateway.client(API_KEY), "say:hi", extra_body={"x_client_id": "banned"})
    assert raised.value.code == "policy_refused" and "this client is banned" in raised.value.message
    asked = provider.webhook_calls[-1]
    assert (asked["client_id"], asked["subject"], asked["auth"], asked["model"]) == (
        "banned",
        "ops-key",
        "api_key",
        MODEL,
    )
    assert asked["prompt_sha256"] == hashlib.sha256(b"say:hi").hexdigest() and "say:hi" not in json.dumps(
        asked
    )


def test_a_webhook_that_times_out_refuses_when_failing_closed(gateway: Gateway) -> None:
    with pytest.raises(openai.APIStatusError) as raised:
        chat(gateway.client(API_KEY), "say:hi", extra_body={"x_client_id": "slow"})
    assert raised.value.status_code == 503 and raised.value.code == "policy_unavailable"


def test_a_webhook_that_times_out_allows_when_failing_open(
    start_gateway: Callable[..., Any],
    provider: IdentityProvider,
    backend: Backend,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    open_gateway = start_policy_gateway(
        start_gateway, provider, backend, tmp_path_factory.mktemp("fail-open"), fail_open=True
    )
    reply = chat(open_gateway.client(API_KEY), "say:let| me in", extra_body={"x_client_id": "slow"})
    assert reply.choices[0].message.content == "let me in"


# ---- audit ----------------------------------------------------------------------------------


def test_every_request_is_one_audit_line_with_hashes_not_texts(
    gateway: Gateway, provider: IdentityProvider
) -> None:
    token = provider.token(provider.published[0], sub="auditee")
    reply = chat(gateway.client(token), "say:one| two", extra_body={"x_client_id": "arm-7", "x_priority": 2})
    line = gateway.audited(reply.id)
    assert line["subject"] == "auditee" and line["auth"] == "oidc" and line["client_id"] == "arm-7"
    assert (line["model"], line["priority"], line["outcome"], line["status"]) == (MODEL, 2, "ok", 200)
    assert (line["prompt_tokens"], line["completion_tokens"], line["finish_reason"]) == (7, 2, "stop")
    assert line["prompt_sha256"] == hashlib.sha256(b"say:one| two").hexdigest()
    assert line["completion_sha256"] == hashlib.sha256(b"one two").hexdigest()
    assert "prompt" not in line and "completion" not in line
    assert 0 < line["latency_ms"] < 30_000 and line["time"].endswith("+00:00")
    before = len(gateway.audit_lines())
    with pytest.raises(openai.AuthenticationError):
        chat(gateway.client(provider.token(provider.published[0], aud="elsewhere")), "say:x")
    with pytest.raises(openai.BadRequestError):
        chat(gateway.client(API_KEY), "forbidden")
    eventually(lambda: len(gateway.audit_lines()) >= before + 2)
    refused = gateway.audit_lines()[before:]
    assert [(r["outcome"], r["status"]) for r in refused] == [
        ("unauthenticated", 401),
        ("policy_refused", 400),
    ]
    assert refused[1]["subject"] == "ops-key" and refused[1]["auth"] == "api_key"


# ---- health ---------------------------------------------------------------------------------


def test_the_probes_name_the_ready_generative_models(gateway: Gateway) -> None:
    for path in ("/readyz", "/healthz", "/livez"):
        reply = httpx.get(gateway.http_url + path)
        assert reply.status_code == 200, path
        assert reply.json()["ready_generative_models"] == [MODEL], path  # not "double" (a tensor model)
    ready = httpx.get(gateway.http_url + "/readyz").json()
    assert ready["ready"] is True and set(ready["ready_models"]) == {MODEL, "double"}
    assert httpx.get(gateway.http_url + "/readyz", params={"model": MODEL}).status_code == 200
    assert httpx.get(gateway.http_url + "/readyz", params={"model": "absent"}).status_code == 503


# ---- the other dialects (docs/dialects.md): the same keys, tokens, guardrails and audit --------


def test_the_dialects_take_the_same_keys_tokens_guardrails_and_audit(
    gateway: Gateway, provider: IdentityProvider, backend: Backend
) -> None:
    token = provider.token(provider.published[0], sub="dialect-user")
    claude = anthropic.Anthropic(base_url=gateway.http_url, api_key=token, max_retries=0, timeout=30)
    message = claude.messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "say:via| tokens"}]
    )
    assert message.content[0].text == "via tokens"  # type: ignore[union-attr]
    line = gateway.audited(message.id)
    assert (line["endpoint"], line["subject"], line["auth"], line["outcome"]) == (
        "anthropic.messages",
        "dialect-user",
        "oidc",
        "ok",
    )
    with claude.messages.stream(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": SAID_FORBIDDEN}]
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == "safe text " and streamed.stop_reason == "refusal"  # type: ignore[union-attr]
    assert gateway.audited(streamed.id)["outcome"] == "content_filter"
    local = ollama.Client(host=gateway.http_url, headers={"authorization": f"Bearer {API_KEY}"})
    with pytest.raises(ollama.ResponseError) as refused:
        local.chat(model=MODEL, messages=[{"role": "user", "content": "this is FORBIDDEN stuff"}])
    assert refused.value.status_code == 400 and "refused by policy" in refused.value.error
    assert not any(r.messages.messages[-1].content == "this is FORBIDDEN stuff" for r in backend.generated)
    # the refusal's audit line is written after its answer: on record before counting, or it
    # could land after `before` and pass for the next request's line
    eventually(
        lambda: any(
            (line["endpoint"], line["outcome"]) == ("ollama.chat", "policy_refused")
            for line in gateway.audit_lines()
        )
    )
    before = len(gateway.audit_lines())
    answered = local.chat(model=MODEL, messages=[{"role": "user", "content": "say:fine"}])
    assert answered.message.content == "fine"
    eventually(lambda: len(gateway.audit_lines()) > before)
    last = gateway.audit_lines()[-1]
    assert (last["endpoint"], last["subject"], last["outcome"]) == ("ollama.chat", "ops-key", "ok")
    with pytest.raises(ollama.ResponseError) as unknown:
        ollama.Client(host=gateway.http_url, headers={"authorization": "Bearer wrong"}).chat(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
    assert unknown.value.status_code == 401


def test_a_client_profile_fills_what_ollama_and_anthropic_requests_leave_out(
    gateway: Gateway, backend: Backend
) -> None:
    """The profile a request matches fills in its priority, system prompt and max tokens,
    whichever API it came by (until 29 November the Ollama and Anthropic routes charged the
    profile's cooldown but dropped what it filled in)."""
    identity = {"x-loadmaster-client-id": PROFILED}
    local = ollama.Client(host=gateway.http_url, headers={"authorization": f"Bearer {API_KEY}", **identity})
    assert local.chat(model=MODEL, messages=[{"role": "user", "content": "say:by|ollama"}]).message.content
    claude = anthropic.Anthropic(
        base_url=gateway.http_url, api_key=API_KEY, max_retries=0, timeout=30, default_headers=identity
    )
    claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "say:by|claude"}])
    for said in ("say:by|ollama", "say:by|claude"):
        [sent] = [r for r in backend.generated if r.messages.messages[-1].content == said]
        assert sent.priority == 3, said
        assert [(m.role, m.content) for m in sent.messages.messages[:1]] == [("system", PROFILE_SYSTEM)]
    [ollama_sent] = [r for r in backend.generated if r.messages.messages[-1].content == "say:by|ollama"]
    assert ollama_sent.sampling.max_tokens == 5  # Ollama's num_predict was left out
    [claude_sent] = [r for r in backend.generated if r.messages.messages[-1].content == "say:by|claude"]
    assert claude_sent.sampling.max_tokens == 8  # the request's own value wins


# ---- drain ----------------------------------------------------------------------------------


def test_a_stream_open_when_its_gateway_gets_sigterm_runs_to_its_end(
    start_gateway: Callable[..., Any], backend: Backend
) -> None:
    """The drain waits for generation streams as for calls: the open stream gets every chunk
    and its end, a new one is refused 503, and the gateway exits 0 once the stream is done."""
    process = start_gateway(scheduler_address=backend.scheduler_address)
    eventually(lambda: httpx.get(process.http_url + "/readyz").status_code == 200, timeout_s=20)
    pieces = [f"p{i} " for i in range(100)]  # a chunk each, 10 ms apart: about a second of stream
    client = openai.OpenAI(base_url=process.http_url + "/v1", api_key="none", max_retries=0, timeout=30)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "say:" + "|".join(pieces)}], stream=True
    )
    chunks = iter(stream)
    text = [next(chunks).choices[0].delta.content or ""]  # the stream is open
    os.killpg(process.process.pid, signal.SIGTERM)
    eventually(lambda: httpx.get(process.http_url + "/readyz").status_code == 503)
    refused = httpx.post(
        process.http_url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "say:late"}], "stream": True},
        timeout=5,
    )
    assert refused.status_code == 503, refused.text
    finish = None
    for chunk in chunks:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(text) == "".join(pieces)
    assert finish == "stop"
    assert process.process.wait(timeout=15) == 0
