"""The engine-process proxy reads an OpenAI-compatible server's stream with httpx-sse: a real
HTTP server on 127.0.0.1 (starlette on uvicorn) sends the event stream as written here, and a
`remote_openai` engine turns it into TokenChunks and one GenerationEnd. What a hand-written
line reader got wrong or let through: comments and `event:`/`id:` fields, a `data:` split over
lines, a 200 that is not an event stream."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from loadmaster.common.ports import free_port
from loadmaster.model_pool.engines.base import EngineContext
from loadmaster.model_pool.engines.remote_openai import RemoteOpenAIEngine
from loadmaster.model_pool.generation import (
    FinishReason,
    GenerationEnd,
    GenerationRequest,
    SamplingParams,
    TokenChunk,
)
from loadmaster.model_pool.repository import ModelRepository


class _Server:
    """Answers every completion with `body` as `content_type`, in the pieces given."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.content_type = "text/event-stream"
        self.port = free_port("127.0.0.1")

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def _completions(self, request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            for piece in self.pieces:
                yield piece

        return StreamingResponse(body(), media_type=self.content_type)

    def run(self) -> Iterator[_Server]:
        app = Starlette(
            routes=[
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
            ]
        )
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        thread = threading.Thread(target=server.run, name="sse-server", daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        try:
            yield self
        finally:
            server.should_exit = True
            thread.join(timeout=10)


@pytest.fixture()
def server() -> Iterator[_Server]:
    yield from _Server().run()


@pytest.fixture()
def engine(server: _Server, tmp_path: Path) -> Iterator[RemoteOpenAIEngine]:
    folder = tmp_path / "remote"
    folder.mkdir()
    (folder / "config.yaml").write_text(
        f"backend: remote_openai\nbase_url: http://127.0.0.1:{server.port}/v1\nremote_model: m\n"
    )
    engine = RemoteOpenAIEngine(ModelRepository(tmp_path).spec("remote"), EngineContext(device="cpu"))
    engine.load()
    try:
        yield engine
    finally:
        engine.unload()


async def _generate(engine: RemoteOpenAIEngine) -> list[object]:
    request = GenerationRequest("r-1", SamplingParams(max_tokens=8, temperature=0.0), prompt="hi")
    stream = await engine.submit(request)
    events: list[object] = []
    async with stream:
        async for event in stream:
            events.append(event)
    return events


def _chunk(text: str, finish: str | None = None) -> str:
    choice: dict[str, object] = {"index": 0, "text": text}
    if finish:
        choice["finish_reason"] = finish
    return json.dumps({"choices": [choice]})


async def test_fields_comments_and_split_data_lines_are_read_as_events(
    server: _Server, engine: RemoteOpenAIEngine
) -> None:
    first, last = _chunk("Hel"), _chunk("lo", "stop")
    server.pieces = [
        b": keep-alive comment\n\n",
        b"event: message\nid: 1\ndata: " + first.encode() + b"\n\n",
        # one event whose data comes in two `data:` lines (joined with a newline: still JSON),
        # and whose bytes arrive in two writes
        b"data: " + last[:10].encode() + b"\ndata: ",
        last[10:].encode() + b"\r\n\r\n",
        b"data: [DONE]\n\n",
        b"data: " + _chunk("after done").encode() + b"\n\n",  # never read
    ]
    events = await _generate(engine)
    assert [e.text for e in events if isinstance(e, TokenChunk)] == ["Hel", "lo"]
    end = events[-1]
    assert isinstance(end, GenerationEnd) and end.finish_reason is FinishReason.STOP, end


async def test_a_200_that_is_not_an_event_stream_ends_in_an_error_naming_it(
    server: _Server, engine: RemoteOpenAIEngine
) -> None:
    server.content_type = "application/json"
    server.pieces = [b'{"choices": [{"index": 0, "text": "whole", "finish_reason": "stop"}]}']
    events = await _generate(engine)
    (end,) = events
    assert isinstance(end, GenerationEnd) and end.finish_reason is FinishReason.ERROR
    assert "did not stream events" in end.error and "application/json" in end.error


async def test_a_chunk_that_is_not_json_ends_in_an_error_quoting_it(
    server: _Server, engine: RemoteOpenAIEngine
) -> None:
    server.pieces = [b"data: " + _chunk("ok").encode() + b"\n\n", b"data: {not json\n\n"]
    events = await _generate(engine)
    assert [e.text for e in events if isinstance(e, TokenChunk)] == ["ok"]
    end = events[-1]
    assert isinstance(end, GenerationEnd) and end.finish_reason is FinishReason.ERROR
    assert "not JSON: '{not json'" in end.error
