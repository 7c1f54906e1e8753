"""The OpenAI routes, driven in-process (ASGI, no sockets) by the official `openai` client, over a
recording stand-in for the rest of the gateway (this module's one collaborator)."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette

from loadmaster.common import tracing
from loadmaster.common.clock import FakeClock
from loadmaster.common.config import ClientsSettings
from loadmaster.common.errors import ExpiredError, LoadmasterError, NotFoundError, UnavailableError
from loadmaster.common.gateway_config import ApiKeySettings, GuardrailSettings
from loadmaster.gateway.auth import Authenticator
from loadmaster.gateway.frontends.openai import openai_routes
from loadmaster.gateway.generation import Finished, GenerationEvent, GenerationRequest, TextChunk, Waiting
from loadmaster.gateway.generation_items import ChoiceEnd, TokenLogprob, ToolCall, TopLogprob
from loadmaster.gateway.guardrails import Guardrails
from loadmaster.gateway.profiles import ClientPolicy
from loadmaster.gateway.request_policy import GatewayPolicy


class Recorded:
    """Answers every request with `pieces`, or fails as told; remembers what it was asked."""

    def __init__(
        self,
        pieces: list[str],
        *,
        fail_before: Exception | None = None,
        fail_after: int | None = None,
        waiting: tuple[Waiting, ...] = (),
    ):
        self.pieces = pieces
        self.fail_before = fail_before
        self.fail_after = fail_after
        self.waiting = waiting
        self.requests: list[tuple[GenerationRequest, str]] = []
        self.tenants: list[str] = []
        self.closed: list[str] = []

    async def generate(
        self, request: GenerationRequest, *, request_id: str, client_id: str, tenant: str = ""
    ) -> AsyncIterator[GenerationEvent]:
        self.requests.append((request, client_id))
        self.tenants.append(tenant)
        try:
            for waiting in self.waiting:
                yield waiting
            if self.fail_before is not None:
                raise self.fail_before
            for index, piece in enumerate(self.pieces):
                if self.fail_after is not None and index == self.fail_after:
                    raise UnavailableError("the worker died")
                yield TextChunk(piece)
            yield Finished("length", prompt_tokens=4, completion_tokens=len(self.pieces))
        finally:
            self.closed.append(request_id)

    async def models(self) -> dict[str, str]:
        return {"tiny-chat": "READY", "other": "IDLE"}


def client_for(
    generations: Recorded, keys: list[ApiKeySettings] | None = None, *, policy: GatewayPolicy | None = None
) -> openai.AsyncOpenAI:
    app = Starlette(
        routes=openai_routes(generations, Authenticator(keys or []), gateway_id="gw", policy=policy)
    )
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
    return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="k", http_client=http, max_retries=0)


MESSAGES = [{"role": "user", "content": "hi"}]


async def test_a_chat_completion_carries_text_usage_and_the_model_header() -> None:
    generations = Recorded(["he", "llo"])
    raw = await client_for(generations).chat.completions.with_raw_response.create(
        model="tiny-chat",
        messages=MESSAGES,
        max_tokens=2,
        extra_body={"x_priority": 0, "x_client_id": "arm-1"},
    )
    reply = raw.parse()
    assert reply.choices[0].message.content == "hello"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (4, 2)
    assert raw.headers["x-loadmaster-model"] == "tiny-chat"
    [(request, client_id)] = generations.requests
    assert (request.priority, request.max_tokens, client_id) == (0, 2, "arm-1")
    assert generations.closed == [reply.id]


async def test_a_chat_stream_delivers_every_chunk_then_usage_then_done() -> None:
    client = client_for(Recorded(["a", "b", "", "c"]))
    stream = await client.chat.completions.create(
        model="tiny-chat", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "abc"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert (
        chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    )
    assert len({c.id for c in chunks}) == 1


async def test_text_completions_stream_and_not() -> None:
    client = client_for(Recorded(["x", "y"]))
    whole = await client.completions.create(model="tiny-chat", prompt="once upon", max_tokens=2)
    assert whole.choices[0].text == "xy" and whole.object == "text_completion"
    parts = [c async for c in await client.completions.create(model="tiny-chat", prompt="p", stream=True)]
    assert "".join(c.choices[0].text for c in parts if c.choices) == "xy"


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (NotFoundError("model 'nope' is not served"), openai.NotFoundError),
        (UnavailableError("no worker holds the model"), openai.InternalServerError),
        (ExpiredError("deadline passed while queued"), openai.APIStatusError),
    ],
)
async def test_errors_before_the_first_chunk_are_statuses(error: LoadmasterError, expected: type) -> None:
    client = client_for(Recorded([], fail_before=error))
    for stream in (False, True):
        with pytest.raises(expected) as caught:
            await client.chat.completions.create(model="tiny-chat", messages=MESSAGES, stream=stream)
        assert caught.value.status_code == error.http_status
        assert caught.value.body["message"] == error.message  # type: ignore[index]


async def test_bad_bodies_are_400s_naming_the_field() -> None:
    client = client_for(Recorded(["a"]))
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="tiny-chat", messages=[], max_tokens=1)
    assert caught.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=0)
    assert caught.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="'model' is a required property") as caught:
        await client.chat.completions.create(model="", messages=MESSAGES)  # and no profile names one
    assert caught.value.param == "model"


async def test_a_failure_mid_stream_is_an_error_event_the_client_raises() -> None:
    generations = Recorded(["a", "b", "c"], fail_after=2)
    stream = await client_for(generations).chat.completions.create(
        model="tiny-chat", messages=MESSAGES, stream=True
    )
    seen = []
    with pytest.raises(openai.APIError, match="the worker died"):
        async for chunk in stream:
            seen.append(chunk)
    assert "".join(c.choices[0].delta.content or "" for c in seen if c.choices) == "ab"
    assert len(generations.closed) == 1


async def test_api_keys_scopes_and_rate_limits_apply() -> None:
    key = ApiKeySettings(name="team", sha256=hashlib.sha256(b"secret").hexdigest(), rate_per_s=1, burst=1)
    app_client = client_for(Recorded(["a"]), keys=[key])
    with pytest.raises(openai.AuthenticationError):
        await app_client.chat.completions.create(model="tiny-chat", messages=MESSAGES)
    good = app_client.with_options(api_key="secret")
    assert (await good.chat.completions.create(model="tiny-chat", messages=MESSAGES)).choices
    with pytest.raises(openai.RateLimitError) as caught:
        await good.chat.completions.create(model="tiny-chat", messages=MESSAGES)
    assert caught.value.response.headers["retry-after"] == "1"  # the next token within a second


async def test_429s_and_503s_say_when_to_come_back() -> None:
    slow = ApiKeySettings(name="slow", sha256=hashlib.sha256(b"s").hexdigest(), rate_per_s=0.25, burst=1)
    client = client_for(Recorded(["a"]), keys=[slow]).with_options(api_key="s")
    await client.chat.completions.create(model="tiny-chat", messages=MESSAGES)
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(model="tiny-chat", messages=MESSAGES)
    assert 3 <= int(caught.value.response.headers["retry-after"]) <= 4  # a token every 4 s
    busy = client_for(Recorded([], fail_before=UnavailableError("no worker holds the model")))
    with pytest.raises(openai.InternalServerError) as unavailable:
        await busy.chat.completions.create(model="tiny-chat", messages=MESSAGES)
    assert unavailable.value.response.headers["retry-after"] == "1"


async def test_a_profile_fills_the_request_and_a_cooldown_is_a_429_with_retry_after() -> None:
    clients = ClientsSettings.model_validate(
        {
            "profiles": {
                "bot": {
                    "match": {"client_id": "bot"},
                    "model": "tiny-chat",
                    "max_tokens": 7,
                    "system_prompt": "Be brief.",
                    "cooldown": {"rate_per_s": 0.5, "burst": 1},
                }
            }
        }
    )
    clock = FakeClock()
    policy = GatewayPolicy(
        Guardrails(GuardrailSettings()), None, clock=clock, clients=ClientPolicy(lambda: clients, clock=clock)
    )
    generations = Recorded(["a"])
    client = client_for(generations, policy=policy)
    reply = await client.chat.completions.create(
        model="", messages=MESSAGES, extra_body={"x_client_id": "bot"}
    )
    assert reply.model == "tiny-chat"
    request, client_id = generations.requests[0]
    assert (request.model, request.max_tokens, client_id) == ("tiny-chat", 7, "bot")
    assert tuple((m.role, m.content) for m in request.messages or ()) == (
        ("system", "Be brief."),
        ("user", "hi"),
    )
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(model="", messages=MESSAGES, extra_body={"x_client_id": "bot"})
    assert caught.value.response.headers["retry-after"] == "2"
    assert caught.value.response.headers["retry-after-ms"] == "2000"
    assert "client 'bot'" in caught.value.message
    assert len(generations.requests) == 1  # the refused request never reached a model
    await client.chat.completions.create(model="tiny-chat", messages=MESSAGES)  # another client: served


async def test_models_are_listed_with_their_state() -> None:
    client = client_for(Recorded([]))
    listed = await client.models.list()
    assert [(m.id, m.x_state) for m in listed.data] == [("other", "IDLE"), ("tiny-chat", "READY")]  # type: ignore[attr-defined]
    assert (await client.models.retrieve("tiny-chat")).id == "tiny-chat"
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("nope")


TRACE_ID, CALLER_SPAN_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = {"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"}


@pytest.fixture()
def exported() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.setup_tracing("gateway", exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown_tracing()


class SeenSpans(Recorded):
    """Remembers the span that was current when each generation started."""

    def __init__(self, pieces: list[str]) -> None:
        super().__init__(pieces)
        self.current: list[trace.SpanContext] = []

    async def generate(
        self, request: GenerationRequest, *, request_id: str, client_id: str, tenant: str = ""
    ) -> AsyncIterator[GenerationEvent]:
        self.current.append(trace.get_current_span().get_span_context())
        async for item in super().generate(
            request, request_id=request_id, client_id=client_id, tenant=tenant
        ):
            yield item


@pytest.mark.parametrize("stream", [False, True])
async def test_a_completion_request_is_a_span_parented_on_the_callers_traceparent(
    exported: InMemorySpanExporter, stream: bool
) -> None:
    generations = SeenSpans(["a", "b"])
    client = client_for(generations)
    if stream:
        chunks = await client.chat.completions.create(
            model="tiny-chat", messages=MESSAGES, stream=True, extra_headers=TRACEPARENT
        )
        assert [c async for c in chunks]
    else:
        await client.completions.create(model="tiny-chat", prompt="hi", extra_headers=TRACEPARENT)
    [span] = [s for s in exported.get_finished_spans() if s.name == "gateway.openai"]
    assert span.context is not None and span.parent is not None
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert format(span.parent.span_id, "016x") == CALLER_SPAN_ID
    assert span.attributes is not None and span.attributes["loadmaster.model_id"] == "tiny-chat"
    assert generations.current == [span.context]  # the port's own spans would be its children


async def test_without_a_traceparent_the_request_span_starts_a_trace(exported: InMemorySpanExporter) -> None:
    await client_for(Recorded(["a"])).completions.create(model="tiny-chat", prompt="hi")
    [span] = [s for s in exported.get_finished_spans() if s.name == "gateway.openai"]
    assert span.parent is None


async def test_the_tenant_is_the_keys_tenant_else_its_name_else_user_else_the_client_id() -> None:
    keys = [
        ApiKeySettings(name="svc", sha256=hashlib.sha256(b"k").hexdigest(), tenant="acme"),
        ApiKeySettings(name="plain", sha256=hashlib.sha256(b"p").hexdigest()),
    ]
    generations = Recorded(["x"])
    await client_for(generations, keys).chat.completions.create(
        model="tiny-chat", messages=MESSAGES, user="alice", extra_body={"x_client_id": "arm"}
    )
    plain = client_for(generations, keys).with_options(api_key="p")
    await plain.chat.completions.create(model="tiny-chat", messages=MESSAGES, user="alice")
    open_mode = Recorded(["x"])
    await client_for(open_mode).chat.completions.create(model="tiny-chat", messages=MESSAGES, user="bob")
    await client_for(open_mode).chat.completions.create(
        model="tiny-chat", messages=MESSAGES, extra_body={"x_client_id": "arm-2"}
    )
    await client_for(open_mode).chat.completions.create(model="tiny-chat", messages=MESSAGES)
    assert generations.tenants == ["acme", "plain"]
    assert open_mode.tenants == ["bob", "arm-2", "openai"]


async def test_a_waiting_stream_says_where_it_stands_in_comment_lines_the_client_skips() -> None:
    waiting = (Waiting(loading=True), Waiting(loading=True, load_fraction=0.456), Waiting(queued_ahead=3))
    generations = Recorded(["he", "llo"], waiting=waiting)
    app = Starlette(routes=openai_routes(generations, Authenticator([]), gateway_id="gw"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        body = {"model": "tiny-chat", "messages": MESSAGES, "stream": True}
        raw = (await http.post("/v1/chat/completions", json=body)).text
    assert (
        raw.index(": loading\n\n")
        < raw.index(": loading 45%\n\n")
        < raw.index(": queued 3\n\n")
        < raw.index("data:")
    )
    client = client_for(Recorded(["he", "llo"], waiting=waiting))
    stream = await client.chat.completions.create(model="tiny-chat", messages=MESSAGES, stream=True)
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    assert text == "hello"
    collected = await client_for(Recorded(["ok"], waiting=waiting)).chat.completions.create(
        model="tiny-chat", messages=MESSAGES
    )
    assert collected.choices[0].message.content == "ok"


class Choices:
    """Two choices: choice 0 text with log probabilities, choice 1 a tool call."""

    def __init__(self) -> None:
        self.requests: list[GenerationRequest] = []

    async def generate(
        self, request: GenerationRequest, *, request_id: str, client_id: str, tenant: str = ""
    ) -> AsyncIterator[GenerationEvent]:
        self.requests.append(request)
        top = (TopLogprob("he", b"he", -0.5), TopLogprob("ha", b"ha", -1.5))
        yield TextChunk("he", logprobs=(TokenLogprob("he", b"he", -0.5, top),))
        yield TextChunk("", choice=1, tool_calls=(ToolCall("call_x", "add", '{"a":1}', 0),))
        yield TextChunk("y", logprobs=(TokenLogprob("y", b"y", -0.25),))
        yield Finished(
            "stop",
            prompt_tokens=3,
            completion_tokens=4,
            choices=(ChoiceEnd(0, "length", 2), ChoiceEnd(1, "tool_calls", 2)),
        )

    async def models(self) -> dict[str, str]:
        return {"tiny-chat": "READY"}


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


async def test_choices_calls_and_logprobs_reach_the_client_whole_and_streamed() -> None:
    generations = Choices()
    app = Starlette(routes=openai_routes(generations, Authenticator([]), gateway_id="gw"))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="k", http_client=http, max_retries=0)
    reply = await client.chat.completions.create(
        model="tiny-chat",
        messages=MESSAGES,
        n=2,
        logprobs=True,
        top_logprobs=2,
        tools=TOOLS,  # type: ignore[arg-type]
    )
    first, second = reply.choices
    assert (first.message.content, first.finish_reason) == ("hey", "length")
    assert first.logprobs is not None and first.logprobs.content is not None
    assert [(i.token, i.logprob) for i in first.logprobs.content] == [("he", -0.5), ("y", -0.25)]
    assert [t.token for t in first.logprobs.content[0].top_logprobs] == ["he", "ha"]
    assert second.finish_reason == "tool_calls" and second.message.content is None
    assert second.message.tool_calls is not None and second.message.tool_calls[0].function.name == "add"
    request = generations.requests[0]
    assert (request.n, request.logprobs) == (2, 2) and request.tools is not None
    stream = await client.chat.completions.create(
        model="tiny-chat",
        messages=MESSAGES,
        n=2,
        logprobs=True,
        tools=TOOLS,
        stream=True,  # type: ignore[arg-type]
    )
    chunks = [chunk async for chunk in stream]
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == [0, 1]  # each choice opens with its role
    calls = [d for c in chunks for ch in c.choices for d in ch.delta.tool_calls or []]
    assert [(d.index, d.id, d.function.name if d.function else "") for d in calls] == [(0, "call_x", "add")]
    finishes = {ch.index: ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason}
    assert finishes == {0: "length", 1: "tool_calls"}
    streamed = [i.token for c in chunks for ch in c.choices if ch.logprobs for i in ch.logprobs.content or []]
    assert streamed == ["he", "y"]
