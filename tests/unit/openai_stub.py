"""A small OpenAI-compatible server that stands in for a hosted API in tests (a "remote").

    with OpenAIStub(key="sk-test", reply="remote words") as remote:
        remote.base_url          # http://127.0.0.1:PORT/v1
        remote.requests          # every body it was sent, in order (with its Authorization)

It serves `GET /v1/models`, `POST /v1/chat/completions` and `POST /v1/completions`, streamed
(SSE, usage in the last chunk when asked) or not, as OpenAI's API does; a missing or wrong key
is a 401. Its answer is `reply`'s words, one per chunk, as many as `max_tokens` allows, so a
test can tell that the remote spoke. A real HTTP server (uvicorn on its own thread, 127.0.0.1
on a free port), stopped when the block ends.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from loadmaster.common.ports import free_port

__all__ = ["OpenAIStub"]


@dataclass
class OpenAIStub:
    key: str | None = None
    reply: str = "remote words from the cloud"
    model: str = "stub-model"
    requests: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> OpenAIStub:
        self.port = free_port("127.0.0.1")
        app = Starlette(
            routes=[
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
            ]
        )
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="openai-stub", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the OpenAI stub did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(timeout=10)

    # ---- routes ------------------------------------------------------------------------

    def _refused(self, request: Request) -> Response | None:
        if self.key is None or request.headers.get("authorization") == f"Bearer {self.key}":
            return None
        error = {
            "message": "Incorrect API key provided",
            "type": "invalid_request_error",
            "code": "invalid_api_key",
        }
        return JSONResponse({"error": error}, status_code=401)

    async def _models(self, request: Request) -> Response:
        if (refused := self._refused(request)) is not None:
            return refused
        return JSONResponse(
            {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "stub"}]}
        )

    async def _chat(self, request: Request) -> Response:
        return await self._answer(request, chat=True)

    async def _completions(self, request: Request) -> Response:
        return await self._answer(request, chat=False)

    async def _answer(self, request: Request, *, chat: bool) -> Response:
        if (refused := self._refused(request)) is not None:
            return refused
        body = json.loads(await request.body())
        self.requests.append({**body, "authorization": request.headers.get("authorization")})
        words = self.reply.split()
        limit = int(body.get("max_tokens") or len(words))
        pieces = [word + " " for word in words[:limit]]
        finish = "length" if limit < len(words) else "stop"
        prompt_tokens = len(json.dumps(body.get("messages") or body.get("prompt")).split())
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(pieces),
                 "total_tokens": prompt_tokens + len(pieces)}  # fmt: skip
        kind = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            text = "".join(pieces)
            choice = {"index": 0, "finish_reason": finish}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return JSONResponse(
                {
                    "id": "stub-1",
                    "object": kind,
                    "model": body.get("model"),
                    "choices": [choice],
                    "usage": usage,
                }
            )

        async def events() -> AsyncIterator[bytes]:
            def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
                data = {"id": "stub-1", "object": kind + ".chunk" if chat else kind, "model": body.get("model"),
                        "choices": choices, **extra}  # fmt: skip
                return b"data: " + json.dumps(data).encode() + b"\n\n"

            for piece in pieces:
                yield chunk(
                    [{"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}]
                )
            yield chunk(
                [
                    {"index": 0, "delta": {}, "finish_reason": finish}
                    if chat
                    else {"index": 0, "text": "", "finish_reason": finish}
                ]
            )
            if (body.get("stream_options") or {}).get("include_usage"):
                yield chunk([], usage=usage)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
