"""`loadmaster chat` against the gateway's OpenAI routes served by a real uvicorn on 127.0.0.1,
with a recording stand-in for the generations behind them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from typer.testing import CliRunner

from loadmaster.cli.main import app
from loadmaster.common.errors import NotFoundError
from loadmaster.gateway.auth import Authenticator
from loadmaster.gateway.frontends.openai import openai_routes
from loadmaster.gateway.generation import Finished, GenerationEvent, GenerationRequest, TextChunk


class Echoing:
    def __init__(self) -> None:
        self.requests: list[GenerationRequest] = []

    async def generate(
        self, request: GenerationRequest, *, request_id: str, client_id: str, tenant: str = ""
    ) -> AsyncIterator[GenerationEvent]:
        if request.model != "tiny-chat":
            raise NotFoundError(f"model '{request.model}' is not served")
        self.requests.append(request)
        assert request.messages is not None
        for word in ("re:", request.messages[-1].content):
            yield TextChunk(word)
        yield Finished("stop", prompt_tokens=3, completion_tokens=2)

    async def models(self) -> dict[str, str]:
        return {"tiny-chat": "READY"}


@pytest.fixture
def gateway() -> Iterator[tuple[str, Echoing]]:
    generations = Echoing()
    routes = openai_routes(generations, Authenticator([]), gateway_id="gw")
    config = uvicorn.Config(
        Starlette(routes=routes), host="127.0.0.1", port=0, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        threading.Event().wait(0.025)
    assert server.started
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", generations
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_chat_streams_replies_and_keeps_the_conversation(gateway: tuple[str, Echoing]) -> None:
    url, generations = gateway
    result = CliRunner().invoke(
        app,
        ["chat", "tiny-chat", "--gateway", url, "--priority", "0", "--system", "be brief"],
        input="hello\nagain\n\n",
    )
    assert result.exit_code == 0, result.output
    assert "re:hello" in result.output and "re:again" in result.output
    first, second = generations.requests
    assert tuple((m.role, m.content) for m in first.messages or ()) == (
        ("system", "be brief"),
        ("user", "hello"),
    )
    assert tuple((m.role, m.content) for m in second.messages or ()) == (
        ("system", "be brief"),
        ("user", "hello"),
        ("assistant", "re:hello"),
        ("user", "again"),
    )
    assert (second.priority, second.client_id) == (0, "loadmaster-chat")


def test_one_message_mode_and_an_unknown_model(gateway: tuple[str, Echoing]) -> None:
    url, _ = gateway
    once = CliRunner().invoke(app, ["chat", "tiny-chat", "--gateway", url, "-m", "ping"])
    assert once.exit_code == 0 and "re:ping" in once.output
    missing = CliRunner().invoke(app, ["chat", "nope", "--gateway", url, "-m", "ping"])
    assert missing.exit_code == 2
    assert "404" in missing.output and "nope" in missing.output
