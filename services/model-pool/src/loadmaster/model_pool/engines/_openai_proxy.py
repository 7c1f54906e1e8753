"""The generation half of engines that forward to an OpenAI-compatible server: an engine
process this worker runs (`openai_process.py`) or a hosted API (`remote_openai.py`).

    submit()   (event loop) forwards the request with an async HTTP client, always streaming;
               the SSE chunks become TokenChunks on the data plane, then one GenerationEnd
    cancel()   ends the stream (CANCELLED) and drops its connection, which aborts it upstream
    fail_all() (any thread) ends every open stream with an error

A subclass sets `_api_url` (the API root, ending in `/v1`), `_served` (the model name the
server is asked for) and `_headers` when it loads, and says whether the server is still
there (`healthy`) and why not (`_gone_message`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
from httpx_sse import SSEError, aconnect_sse

from loadmaster.common.errors import InvalidArgumentError, UnavailableError
from loadmaster.model_pool.engines._proxy_streams import (
    ProxyGeneration,
    ProxyStream,
    openai_response_format,
    request_body,
)
from loadmaster.model_pool.engines.base import Engine, EngineContext
from loadmaster.model_pool.generation import FinishReason, GenerationRequest, GenerationStats
from loadmaster.model_pool.repository import ModelSpec

__all__ = ["OpenAIProxyEngine"]

log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 5.0


def refuse_unproxied(request: GenerationRequest, model_id: str) -> None:
    """What the proxy does not carry to an OpenAI-compatible server yet is a 400 naming it,
    never dropped: tools, log probabilities, n > 1 (docs/tool-calling.md)."""
    where = (
        f"model '{model_id}' is served through an OpenAI-compatible server, which Loadmaster does not pass"
    )
    if request.tools is not None:
        raise InvalidArgumentError(f"tools: {where} tools to")
    if request.logprobs is not None:
        raise InvalidArgumentError(f"logprobs: {where} log probabilities from")
    if request.n > 1:
        raise InvalidArgumentError(f"n: {where} several choices to")


class OpenAIProxyEngine(Engine):
    """Streams generations to an OpenAI-compatible server at `_api_url`."""

    def __init__(
        self,
        spec: ModelSpec,
        context: EngineContext,
        *,
        max_sequences: int,
        request_timeout_s: float,
        forward_priority: bool = False,
    ) -> None:
        super().__init__(spec, context)
        self._max_sequences = max_sequences
        self._forward_priority = forward_priority  # the body's `priority` (vLLM's scheduling)
        self._request_timeout_s = request_timeout_s
        self._api_url = ""  # e.g. http://127.0.0.1:8000/v1
        self._served = ""
        self._headers: dict[str, str] = {}
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, ProxyStream] = {}

    # ---- what a subclass says --------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return True

    def _gone_message(self) -> str:
        return f"model '{self.spec.model_id}' is not loaded"

    def _serving(self) -> bool:
        """Whether a request may be forwarded now."""
        return bool(self._api_url)

    # ---- generation (on the event loop) ---------------------------------------------

    async def submit(self, request: GenerationRequest) -> ProxyGeneration:
        """Validate and forward one generation; its events follow on the returned stream."""
        request.check()
        if not self._serving():
            raise UnavailableError(self._gone_message())
        if request.request_id in self._streams:
            raise InvalidArgumentError(f"request_id: {request.request_id!r} is already generating")
        refuse_unproxied(request, self.spec.model_id)
        self._loop = asyncio.get_running_loop()
        # Structured output (issue 22): the server enforces `response_format` itself.
        response_format = openai_response_format(getattr(request, "response_format", None))
        path, body = request_body(
            request,
            model=self._served,
            response_format=response_format,
            forward_priority=self._forward_priority,
        )
        state = ProxyStream(request.request_id, request.params.stop, self._forget)
        self._streams[request.request_id] = state
        state.task = asyncio.create_task(
            self._forward(state, path.removeprefix("/v1"), body), name=f"engine-{request.request_id}"
        )
        return ProxyGeneration(state, self.cancel)

    def cancel(self, request_id: str) -> bool:
        """End a generation (CANCELLED) and drop its connection, which aborts it upstream."""
        state = self._streams.get(request_id)
        if state is None:
            return False
        state.end(FinishReason.CANCELLED)
        if state.task is not None:
            state.task.cancel()
        return True

    def stats(self) -> GenerationStats:
        return GenerationStats(
            running=len(self._streams),
            waiting=0,
            kv_blocks_used=0,
            kv_blocks_total=0,
            streams_open=len(self._streams),
        )

    # ---- helpers --------------------------------------------------------------------

    async def _forward(self, state: ProxyStream, path: str, body: dict[str, Any]) -> None:
        client = self._http()
        try:
            async with aconnect_sse(client, "POST", path, json=body) as events:
                response = events.response
                if response.status_code != 200:
                    detail = (await response.aread()).decode("utf-8", errors="replace")[:1000]
                    state.end(FinishReason.ERROR, f"the engine answered {response.status_code}: {detail}")
                    return
                async for event in events.aiter_sse():  # httpx-sse parses the event stream
                    if event.data == "[DONE]":
                        break
                    try:
                        chunk = event.json()
                    except ValueError:
                        state.end(
                            FinishReason.ERROR,
                            f"the engine sent a chunk that is not JSON: {event.data[:200]!r}",
                        )
                        return
                    if state.feed(chunk):
                        return
            state.finished()
        except asyncio.CancelledError:
            state.end(FinishReason.CANCELLED)
            raise
        except SSEError as error:  # answered 200, but not with an event stream
            state.end(FinishReason.ERROR, f"the engine did not stream events: {error}")
        except httpx.HTTPError as error:
            await self._settle_exit()
            state.end(
                FinishReason.ERROR,
                self._gone_message() if not self.healthy else f"engine request failed: {error!r}",
            )

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            timeout = httpx.Timeout(connect=5.0, read=self._request_timeout_s, write=30.0, pool=30.0)
            limits = httpx.Limits(max_connections=self._max_sequences * 2, max_keepalive_connections=64)
            self._client = httpx.AsyncClient(
                base_url=self._api_url, headers=self._headers, timeout=timeout, limits=limits
            )
        return self._client

    async def _settle_exit(self) -> None:
        """A broken connection may come just before the server's end is seen (a subclass waits)."""

    def fail_all(self, message: str) -> None:
        """From any thread: end every open stream with `message`."""
        for state in list(self._streams.values()):
            self._fail_threadsafe(state, message)

    def _fail_threadsafe(self, state: ProxyStream, message: str) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._fail, state, message)
        except RuntimeError:
            pass  # the loop closed meanwhile: nobody is listening

    def _fail(self, state: ProxyStream, message: str) -> None:
        state.end(FinishReason.ERROR, message)
        if state.task is not None:
            state.task.cancel()

    def _forget(self, state: ProxyStream) -> None:
        key = state.request_id
        if self._streams.get(key) is state:
            del self._streams[key]

    def _close_client(self) -> None:
        """From the instance's thread: close the HTTP client on the loop it was made on."""
        client, self._client = self._client, None
        loop = self._loop
        if client is None or loop is None or loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(client.aclose(), loop).result(_CLOSE_TIMEOUT_S)
        except Exception as error:
            log.debug("closing the HTTP client of %s: %s", self.spec.model_id, error)
