"""The Ollama routes, driven in-process (ASGI, no sockets) by the official `ollama` client, over a
recording stand-in for the rest of the gateway (this module's one collaborator): what each body
becomes on the OpenAI plane, the replies' shapes, and each 400 with its message."""

from __future__ import annotations

import base64
import hashlib
import io
from collections.abc import AsyncIterator

import httpx
import numpy as np
import ollama
import pytest
from PIL import Image
from starlette.applications import Starlette

from loadmaster.common.errors import NotFoundError, UnavailableError
from loadmaster.common.gateway_config import ApiKeySettings
from loadmaster.gateway.auth import Authenticator
from loadmaster.gateway.catalog import ModelView
from loadmaster.gateway.embeddings import EmbeddingRequest, EmbeddingResult
from loadmaster.gateway.frontends.dialect_calls import DialectCalls
from loadmaster.gateway.frontends.ollama import ollama_routes, parse_keep_alive
from loadmaster.gateway.frontends.openai_schema import ChatCompletionBody
from loadmaster.gateway.generation import Finished, GenerationEvent, GenerationRequest, TextChunk
from loadmaster.gateway.generation_items import FunctionSpec, ToolCall, ToolUse


def turns(request: GenerationRequest) -> tuple[tuple[str, str], ...] | None:
    """A request's chat as (role, text) pairs."""
    return None if request.messages is None else tuple((t.role, t.content) for t in request.messages)


class Recorded:
    """Answers every request with `pieces` (or fails as told); remembers what it was asked."""

    def __init__(
        self,
        pieces: list[str],
        *,
        fail_before: Exception | None = None,
        fail_after: int | None = None,
        calls: tuple[ToolCall, ...] = (),
    ):
        self.pieces = pieces
        self.calls = calls
        self.fail_before = fail_before
        self.fail_after = fail_after
        self.requests: list[tuple[GenerationRequest, str]] = []
        self.closed: list[str] = []
        self.loaded: list[str] = []
        self.keep_alive: list[float | None] = []
        self.unloaded: list[str] = []

    async def generate(
        self, request: GenerationRequest, *, request_id: str, client_id: str, tenant: str = ""
    ) -> AsyncIterator[GenerationEvent]:
        self.requests.append((request, client_id))
        try:
            if self.fail_before is not None:
                raise self.fail_before
            for index, piece in enumerate(self.pieces):
                if self.fail_after is not None and index == self.fail_after:
                    raise UnavailableError("the worker died")
                yield TextChunk(piece)
            if self.calls:
                yield TextChunk("", tool_calls=self.calls)
            yield Finished(
                "tool_calls" if self.calls else "stop", prompt_tokens=7, completion_tokens=len(self.pieces)
            )
        finally:
            self.closed.append(request_id)

    async def models(self) -> dict[str, str]:
        return {"tiny-chat": "READY", "tiny-vlm": "IDLE", "chat": "READY", "tiny-embed": "READY"}

    async def views(self) -> dict[str, ModelView]:
        return {
            "tiny-chat": ModelView("tiny-chat", "READY", backend="transformers"),
            "tiny-vlm": ModelView("tiny-vlm", "UNAVAILABLE", "not loaded", backend="transformers_vlm"),
            "tiny-embed": ModelView("tiny-embed", "READY", backend="embedding"),
        }

    async def load(self, name: str, *, keep_alive_s: float | None = None) -> None:
        self.loaded.append(name)
        self.keep_alive.append(keep_alive_s)

    async def unload(self, name: str) -> None:
        self.unloaded.append(name)


class Embeddings:
    """Answers every embedding call with a vector per input; remembers what it was asked."""

    def __init__(self) -> None:
        self.requests: list[tuple[EmbeddingRequest, str]] = []

    async def embed(self, request: EmbeddingRequest, *, request_id: str, client_id: str) -> EmbeddingResult:
        self.requests.append((request, client_id))
        rows = [[float(i), 0.5, -1.0] for i in range(len(request.inputs))]
        return EmbeddingResult(np.asarray(rows, dtype=np.float32), tuple(3 for _ in request.inputs))


def client_for(
    generations: Recorded,
    keys: list[ApiKeySettings] | None = None,
    embedder: Embeddings | None = None,
    **headers: str,
) -> ollama.AsyncClient:
    auth = Authenticator(keys or [])
    routes = ollama_routes(
        DialectCalls(generations, auth, client_type="ollama"),
        auth,
        models=generations.models,
        views=generations.views,
        load=generations.load,
        unload=generations.unload,
        gateway_id="gw",
        max_body_bytes=1 << 20,
        embedder=embedder,  # type: ignore[arg-type]
    )
    app = Starlette(routes=routes)
    return ollama.AsyncClient(host="http://gateway", transport=httpx.ASGITransport(app=app), headers=headers)


def png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (4, 4), (200, 10, 10)).save(out, format="PNG")
    return out.getvalue()


HI = [{"role": "user", "content": "hi"}]


async def test_a_chat_maps_options_format_and_keep_alive_onto_the_openai_plane() -> None:
    generations = Recorded(["he", "llo"])
    reply = await client_for(generations).chat(
        model="tiny-chat:latest",
        messages=[{"role": "system", "content": "be brief"}, *HI],
        stream=False,
        format="json",
        options={"temperature": 0, "top_p": 0.5, "seed": 7, "num_predict": 2, "stop": ["\n"]},
        keep_alive="5m",
    )
    assert reply.message.content == "hello" and reply.done and reply.done_reason == "stop"
    assert reply.model == "tiny-chat:latest"
    assert (reply.prompt_eval_count, reply.eval_count) == (7, 2)
    assert reply.total_duration is not None and reply.total_duration >= (reply.eval_duration or 0)
    [(request, client_id)] = generations.requests
    assert request.model == "tiny-chat" and turns(request) == (("system", "be brief"), ("user", "hi"))
    assert (request.temperature, request.top_p, request.seed, request.max_tokens) == (0.0, 0.5, 7, 2)
    assert request.stop == ("\n",) and request.keep_alive_s == 300.0
    assert request.response_format == {"type": "json_object"} and client_id == "ollama"


async def test_a_streamed_chat_is_ndjson_chunks_then_the_done_line() -> None:
    generations = Recorded(["a", "", "b"])
    parts = [
        part async for part in await client_for(generations).chat(model="tiny-chat", messages=HI, stream=True)
    ]
    assert [p.message.content for p in parts] == ["a", "b", ""]
    assert [p.done for p in parts] == [False, False, True]
    assert parts[-1].done_reason == "stop" and parts[-1].eval_count == 3
    assert len(generations.closed) == 1


async def test_a_schema_format_is_structured_output() -> None:
    generations = Recorded(["{}"])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    await client_for(generations).chat(model="tiny-chat", messages=HI, format=schema)
    [(request, _)] = generations.requests
    assert request.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "ollama", "schema": schema},
    }


async def test_generate_applies_the_template_unless_raw() -> None:
    generations = Recorded(["x"])
    client = client_for(generations)
    reply = await client.generate(model="tiny-chat", prompt="once", system="be brief")
    assert reply.response == "x" and reply.done
    raw = await client.generate(model="tiny-chat", prompt="once upon", raw=True)
    assert raw.response == "x"
    streamed = [p.response async for p in await client.generate(model="tiny-chat", prompt="p", stream=True)]
    assert streamed == ["x", ""]
    chat_request, raw_request = generations.requests[0][0], generations.requests[1][0]
    assert turns(chat_request) == (("system", "be brief"), ("user", "once")) and chat_request.prompt is None
    assert raw_request.prompt == "once upon" and raw_request.messages is None


async def test_images_become_data_url_image_parts() -> None:
    generations = Recorded(["a"])
    image = png()
    await client_for(generations).chat(
        model="tiny-vlm", messages=[{"role": "user", "content": "what?", "images": [image]}]
    )
    [(request, _)] = generations.requests
    assert turns(request) == (("user", "what?"),)
    [chat_image] = request.images
    assert chat_image.message == 0
    assert chat_image.url == "data:image/png;base64," + base64.b64encode(image).decode()


async def test_models_are_listed_as_name_latest_and_both_names_work() -> None:
    generations = Recorded(["a"])
    client = client_for(generations)
    listed = await client.list()
    assert [m.model for m in listed.models] == [
        "chat:latest",
        "tiny-chat:latest",
        "tiny-embed:latest",
        "tiny-vlm:latest",
    ]
    assert listed.models[1].digest == hashlib.sha256(b"tiny-chat").hexdigest()
    running = await client.ps()
    assert [m.model for m in running.models] == ["chat:latest", "tiny-chat:latest", "tiny-embed:latest"]
    for name in ("tiny-chat", "tiny-chat:latest"):
        await client.chat(model=name, messages=HI)
    assert [r.model for r, _ in generations.requests] == ["tiny-chat", "tiny-chat"]
    shown = await client.show("tiny-vlm:latest")
    assert shown.capabilities == ["completion", "vision"]
    assert (await client.show("tiny-chat")).capabilities == ["completion"]
    assert (await client.show("tiny-embed")).capabilities == ["embedding"]
    with pytest.raises(ollama.ResponseError) as caught:
        await client.show("nope")
    assert caught.value.status_code == 404 and "nope" in caught.value.error


async def test_version_and_root_answer() -> None:
    app_client = client_for(Recorded([]))
    transport = app_client._client._transport
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        assert (await http.get("/")).text == "Ollama is running"
        assert (await http.head("/")).status_code == 200
        assert (await http.get("/api/version")).json()["version"]


async def test_an_empty_chat_loads_and_keep_alive_zero_unloads() -> None:
    generations = Recorded([])
    client = client_for(generations)
    loaded = await client.chat(model="tiny-chat:latest", messages=[])
    assert loaded.done_reason == "load" and generations.loaded == ["tiny-chat"]
    unloaded = await client.generate(model="tiny-chat", keep_alive=0)
    assert unloaded.done_reason == "unload" and generations.unloaded == ["tiny-chat"]
    await client.generate(model="tiny-chat", keep_alive=-1)  # preload, kept until unloaded
    assert generations.loaded == ["tiny-chat", "tiny-chat"] and generations.keep_alive == [None, -1.0]
    assert generations.requests == []


async def test_unloading_needs_the_admin_scope() -> None:
    key = ApiKeySettings(name="team", sha256=hashlib.sha256(b"secret").hexdigest())
    generations = Recorded([])
    client = client_for(generations, keys=[key], authorization="Bearer secret")
    with pytest.raises(ollama.ResponseError) as caught:
        await client.generate(model="tiny-chat", keep_alive=0)
    assert caught.value.status_code == 403 and generations.unloaded == []
    assert (await client.generate(model="tiny-chat")).done_reason == "load"


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        ({"options": {"top_k": 3}}, "options.top_k: not supported"),
        ({"options": {"num_ctx": 4096}}, "options.num_ctx: not supported"),
        ({"options": {"temperature": 3}}, "options.temperature"),
        ({"options": {"num_predict": -1}}, "options.num_predict"),
        ({"format": "yaml"}, "format"),
        ({"keep_alive": "soon"}, "keep_alive"),
        ({"think": "high"}, "think"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!", "parameters": {}}}]},
            "tools.0.function.name",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}
                ]
            },
            "messages[0].tool_calls[0].function",
        ),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "x", "images": ["%%%"]}]}, "messages[0].images[0]"),
        ({"messages": HI * 2049}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "images": ["aGk="] * 257}]}, "messages.0.images"),
    ],
)
async def test_what_cannot_be_honoured_is_a_400_naming_it(call: dict[str, object], needle: str) -> None:
    generations = Recorded(["a"])
    body = {"model": "tiny-chat", "messages": HI, "stream": False, **call}
    async with httpx.AsyncClient(
        transport=client_for(generations)._client._transport, base_url="http://gateway"
    ) as http:
        response = await http.post("/api/chat", json=body)
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]
    assert generations.requests == []


@pytest.mark.parametrize(
    ("field", "needle"), [("suffix", "suffix: fill-in"), ("context", "context"), ("template", "template")]
)
async def test_generate_fields_that_cannot_be_honoured_are_400s(field: str, needle: str) -> None:
    generations = Recorded(["a"])
    value: object = [1, 2] if field == "context" else "x"
    with pytest.raises(ollama.ResponseError) as caught:
        await client_for(generations).generate(model="tiny-chat", prompt="p", **{field: value})  # type: ignore[arg-type]
    assert caught.value.status_code == 400 and needle in caught.value.error


async def test_errors_keep_ollamas_shape_and_a_failure_mid_stream_ends_it() -> None:
    client = client_for(Recorded([], fail_before=NotFoundError("model 'nope' is not served")))
    for stream in (False, True):
        with pytest.raises(ollama.ResponseError) as caught:
            result = await client.chat(model="nope", messages=HI, stream=stream)
            if stream:
                [part async for part in result]  # type: ignore[union-attr]
        assert caught.value.status_code == 404 and caught.value.error == "model 'nope' is not served"
    generations = Recorded(["a", "b", "c"], fail_after=2)
    seen = []
    with pytest.raises(ollama.ResponseError, match="the worker died"):
        async for part in await client_for(generations).chat(model="tiny-chat", messages=HI, stream=True):
            seen.append(part.message.content)
    assert seen == ["a", "b"] and len(generations.closed) == 1


async def test_rate_limits_answer_429_with_retry_after() -> None:
    key = ApiKeySettings(name="team", sha256=hashlib.sha256(b"secret").hexdigest(), rate_per_s=0.5, burst=1)
    client = client_for(Recorded(["a"]), keys=[key], authorization="Bearer secret")
    await client.chat(model="tiny-chat", messages=HI)
    async with httpx.AsyncClient(transport=client._client._transport, base_url="http://gateway") as http:
        response = await http.post(
            "/api/chat",
            json={"model": "tiny-chat", "messages": HI},
            headers={"authorization": "Bearer secret"},
        )
    assert response.status_code == 429 and response.headers["retry-after"] == "2"
    assert "rate limit" in response.json()["error"]


async def test_loadmaster_headers_set_priority_deadline_and_client() -> None:
    generations = Recorded(["a"])
    headers = {
        "X-Loadmaster-Priority": "0",
        "X-Loadmaster-Urgency": "0.5",
        "X-Loadmaster-Deadline-Ms": "250",
        "X-Loadmaster-Client-Id": "arm-1",
    }
    await client_for(generations, **headers).chat(model="tiny-chat", messages=HI)
    [(request, client_id)] = generations.requests
    assert (request.priority, request.urgency, request.deadline_ms, client_id) == (0, 0.5, 250.0, "arm-1")
    with pytest.raises(ollama.ResponseError) as caught:
        await client_for(generations, **{"X-Loadmaster-Priority": "urgent"}).chat(
            model="tiny-chat", messages=HI
        )
    assert caught.value.status_code == 400 and "X-Loadmaster-Priority" in caught.value.error


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        (0, 0.0),
        (30, 30.0),
        ("10s", 10.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("-1", -1.0),
        ("-1m", -60.0),
        ("250ms", 0.25),
    ],
)
def test_keep_alive_durations(value: float | str | None, seconds: float | None) -> None:
    assert parse_keep_alive(value) == seconds


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


async def test_tools_and_a_tool_history_reach_the_request() -> None:
    generations = Recorded(["12 C in Oslo"])
    await client_for(generations).chat(
        model="tiny-chat",
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "weather in Oslo?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
            },
            {"role": "tool", "content": "12 C", "tool_name": "get_weather"},
        ],
    )
    [(request, _)] = generations.requests
    function = FunctionSpec("get_weather", "the weather in a city", WEATHER["function"]["parameters"])  # type: ignore[index]
    assert request.tools == ToolUse((function,), choice="auto")
    assert request.messages is not None
    _, assistant, tool = request.messages
    assert assistant.tool_calls == (ToolCall("call_1_0", "get_weather", '{"city":"Oslo"}', 0),)
    assert (tool.role, tool.tool_call_id, tool.name, tool.content) == (
        "tool",
        "call_1_0",
        "get_weather",
        "12 C",
    )


async def test_a_reply_with_tool_calls_carries_them_as_ollama_does() -> None:
    call = ToolCall("call_9", "get_weather", '{"city": "Oslo"}')
    client = client_for(Recorded([], calls=(call,)))
    reply = await client.chat(model="tiny-chat", messages=HI, tools=[WEATHER])
    assert reply.done_reason == "stop" and reply.message.tool_calls is not None
    [made] = reply.message.tool_calls
    assert (made.function.name, made.function.arguments) == ("get_weather", {"city": "Oslo"})
    parts = [p async for p in await client.chat(model="tiny-chat", messages=HI, tools=[WEATHER], stream=True)]
    assert [bool(p.message.tool_calls) for p in parts] == [True, False] and parts[-1].done


async def test_think_is_the_thinking_switch_where_the_server_has_one() -> None:
    generations = Recorded(["a"])
    client = client_for(generations)
    if "chat_template_kwargs" not in ChatCompletionBody.model_fields:
        with pytest.raises(ollama.ResponseError, match="think: this server has no thinking switch"):
            await client.chat(model="tiny-chat", messages=HI, think=True)
        return
    await client.chat(model="tiny-chat", messages=HI, think=False)
    [(request, _)] = generations.requests
    assert request.chat_template_kwargs == {"enable_thinking": False}  # type: ignore[attr-defined]


async def test_a_client_without_a_valid_key_is_refused_before_its_body_is_read() -> None:
    key = ApiKeySettings(name="team", sha256=hashlib.sha256(b"secret").hexdigest())
    client = client_for(Recorded(["a"]), keys=[key])
    async with httpx.AsyncClient(transport=client._client._transport, base_url="http://gateway") as http:
        response = await http.post(
            "/api/chat", content=b"{not json", headers={"authorization": "Bearer wrong"}
        )
    assert response.status_code == 401 and "not valid" in response.json()["error"]


async def test_embed_is_one_embedding_call_per_request() -> None:
    embedder = Embeddings()
    client = client_for(Recorded([]), embedder=embedder, **{"X-Loadmaster-Priority": "0"})
    reply = await client.embed(model="tiny-embed:latest", input=["one", "two"], dimensions=3)
    assert reply.embeddings == [[0.0, 0.5, -1.0], [1.0, 0.5, -1.0]] and reply.prompt_eval_count == 6
    assert reply.model == "tiny-embed:latest"
    single = await client.embed(model="tiny-embed", input="one", truncate=False)
    assert single.embeddings == [[0.0, 0.5, -1.0]]
    older = await client.embeddings(model="tiny-embed", prompt="one")
    assert list(older.embedding) == [0.0, 0.5, -1.0]
    [(first, client_id), (second, _), (third, _)] = embedder.requests
    assert (first.model, first.inputs, first.dimensions, first.priority) == (
        "tiny-embed",
        ("one", "two"),
        3,
        0,
    )
    assert (second.inputs, third.inputs, client_id) == (("one",), ("one",), "ollama")


@pytest.mark.parametrize(
    ("body", "needle"),
    [(b"{not json", "not valid JSON"), (b"[" * 100_000, "not valid JSON"), (b"[1]", "object")],
)
async def test_a_body_that_is_not_a_json_object_is_a_400(body: bytes, needle: str) -> None:
    generations = Recorded(["a"])
    async with httpx.AsyncClient(
        transport=client_for(generations)._client._transport, base_url="http://gateway"
    ) as http:
        response = await http.post("/api/chat", content=body)
    assert response.status_code == 400 and needle in response.json()["error"], response.text


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        ({"truncate": True}, "truncate"),
        ({"options": {"num_ctx": 512}}, "options.num_ctx"),
        ({"keep_alive": "5m"}, "keep_alive"),
        ({"input": []}, "input: at least one"),
        ({"input": ["a", ""]}, "input[1]: empty"),
        ({"dimensions": 0}, "dimensions"),
    ],
)
async def test_embed_refuses_what_it_cannot_honour(call: dict[str, object], needle: str) -> None:
    embedder = Embeddings()
    body = {"model": "tiny-embed", "input": "x", **call}
    async with httpx.AsyncClient(
        transport=client_for(Recorded([]), embedder=embedder)._client._transport, base_url="http://gateway"
    ) as http:
        response = await http.post("/api/embed", json=body)
    assert response.status_code == 400 and needle in response.json()["error"], response.text
    assert embedder.requests == []
