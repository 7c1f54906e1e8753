"""KServe v2 over HTTP (Starlette app served by uvicorn in the gateway's loop): translation only.

Routes: `/v2/health/{live,ready}`, `/v2`, `/v2/models/{m}[/versions/{v}][/ready|/config|/stats|/infer]`,
`/v2/models/stats`, `/v2/repository/index`, `/v2/repository/models/{m}/{load,unload}`; and the probes
`/livez`, `/readyz` (503 until the scheduler is connected and a model is READY; with
`?model=<id>`, until that model is READY), `/healthz`, each naming the READY generative models;
and the OpenAI-compatible API (`/v1/...`, frontends/openai.py) over the dispatcher's generations.
The admin API (`/admin/v1/...`, frontends/admin_http.py) comes in through `extra_routes`.
Errors are `LoadmasterError`s mapped to a status in one handler (`{"error": message}` bodies). A
client that disconnects while its request waits cancels it in the dispatcher. A W3C `traceparent`
header is honoured: the request's span (the dispatcher's `gateway.request`) is its child.

Bounds (`LimitsSettings`): a JSON body up to `max_json_bytes`, binary tensor data up to
`max_payload_bytes` after it; request headers must arrive within `http_header_timeout_s` (else
408 and the connection closes) and the body within `http_body_timeout_s` (408). Bodies larger
than `INLINE_BODY_BYTES` are parsed and checked on the validation threads, off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import h11
import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from loadmaster.common import tracing
from loadmaster.common.errors import InternalError, InvalidArgumentError, LoadmasterError, NotFoundError
from loadmaster.common.gateway_config import GatewaySettings
from loadmaster.common.http_server import main_loop
from loadmaster.gateway.auth import ADMIN, INFER, Authenticator, bearer_token
from loadmaster.gateway.calls import InferenceCall
from loadmaster.gateway.catalog import ModelCatalog
from loadmaster.gateway.chat_images import ChatImages
from loadmaster.gateway.dispatcher import Dispatcher
from loadmaster.gateway.embeddings import Embedder
from loadmaster.gateway.frontends.anthropic import anthropic_routes
from loadmaster.gateway.frontends.dialect_calls import DialectCalls
from loadmaster.gateway.frontends.disconnects import ClientGone, unless_client_leaves
from loadmaster.gateway.frontends.http_codec import (
    HEADER_LENGTH,
    ParsedInfer,
    encode_response_parts,
    json_encoding_bytes,
    parse_infer,
)
from loadmaster.gateway.frontends.ollama import ollama_routes
from loadmaster.gateway.frontends.openai import openai_routes
from loadmaster.gateway.frontends.request_headers import RequestHints, hints_from, retry_after
from loadmaster.gateway.generation import RequestPolicy
from loadmaster.gateway.generations import GenerationRouter
from loadmaster.gateway.kserve_calls import (
    EXTENSIONS,
    SERVER_NAME,
    SERVER_VERSION,
    build_call,
    check_parameters,
    outputs_of,
    parse_priority,
    parse_timeout_ms,
    tensor_metadata,
)
from loadmaster.gateway.kserve_generative import GenerativeKServe, with_generative_tensors
from loadmaster.gateway.readiness import Readiness
from loadmaster.gateway.statistics import StatisticsSource, empty_v2
from loadmaster.gateway.validation import off_loop
from loadmaster.v1 import errors_pb2

__all__ = ["INLINE_BODY_BYTES", "HttpFrontend", "RequestTimeoutError", "build_app"]

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]
INLINE_BODY_BYTES = 64 << 10  # infer bodies up to this size are parsed on the event loop
# Binary reply data past this size is streamed in chunks of REPLY_CHUNK_BYTES as the client
# takes them, straight from the worker's reply frame: a 64 MiB reply is never copied whole
# (joined to its header, into h11's output, into the transport's buffer) on the event loop.
STREAM_REPLY_BYTES = 1 << 20
REPLY_CHUNK_BYTES = 1 << 20
MODEL_VERSION = "1"  # the one version each model is served at
LIVEZ_CHECK_S = 0.5  # /livez waits this long at most for a fresh readiness check


class RequestTimeoutError(LoadmasterError):
    """The request body did not arrive in time (HTTP 408)."""

    code = errors_pb2.ERROR_CODE_EXPIRED
    http_status = 408


async def _error_response(request: Request, error: Exception) -> Response:
    """The one place HTTP maps errors to statuses."""
    mapped = error if isinstance(error, LoadmasterError) else None
    if mapped is None:
        log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=error)
        mapped = InternalError(f"internal error: {type(error).__name__}")
    headers = retry_after(mapped) or {}
    if isinstance(mapped, RequestTimeoutError):  # the rest of the body may still come: not a request
        headers["connection"] = "close"
    return JSONResponse({"error": mapped.message}, status_code=mapped.http_status, headers=headers)


async def _read_body(request: Request, limit: int, *, timeout_s: float) -> bytes | memoryview:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise InvalidArgumentError(f"request body of {declared} bytes exceeds the limit of {limit}")
    if request.headers.get("content-encoding", "identity").lower() not in ("identity", ""):
        raise InvalidArgumentError("Content-Encoding is not supported; send the body uncompressed")
    # A large body of known length is copied into place chunk by chunk as it arrives: joining
    # 64 MiB at the end would be one copy holding the event loop for tens of milliseconds, and
    # so would zero-filling a bytearray of that size (numpy's empty buffer is not touched).
    expected = int(declared) if declared is not None and declared.isdigit() else 0
    into = np.empty(expected, np.uint8).data if expected > INLINE_BODY_BYTES else None
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                if size + len(chunk) > limit:
                    raise InvalidArgumentError(f"request body exceeds the limit of {limit} bytes")
                if into is None:
                    chunks.append(chunk)
                elif size + len(chunk) <= expected:
                    into[size : size + len(chunk)] = chunk
                else:  # (h11 frames bodies by Content-Length: this is a guard, not a path)
                    raise InvalidArgumentError("request body is longer than its Content-Length")
                size += len(chunk)
    except TimeoutError:
        raise RequestTimeoutError(
            f"request body not received within {timeout_s:g} s ({size} bytes arrived)"
        ) from None
    if into is not None:
        return into if size == expected else into[:size]
    return b"".join(chunks)


def build_app(
    settings: GatewaySettings,
    dispatcher: Dispatcher,
    catalog: ModelCatalog,
    statistics: StatisticsSource,
    readiness: Readiness,
    auth: Authenticator,
    *,
    gateway_id: str,
    generations: GenerationRouter,
    generative: GenerativeKServe,
    extra_routes: Sequence[BaseRoute] = (),
    policy: RequestPolicy | None = None,
    images: ChatImages | None = None,
    embedder: Embedder | None = None,
) -> Starlette:
    limits = settings.limits
    ids = (f"{gateway_id}-h{n}" for n in itertools.count(1))

    async def read_body(request: Request, limit: int) -> bytes | memoryview:
        return await _read_body(request, limit, timeout_s=limits.http_body_timeout_s)

    async def authorize(request: Request, scope: str) -> str:
        return (await auth.authenticate(bearer_token(request.headers.get("authorization")), scope)).name

    async def livez(request: Request) -> Response:
        # Always 200, and never slow: the models are a fresh check's, or the latest one's when
        # the scheduler is slow to answer.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LIVEZ_CHECK_S):
                await readiness.check()
        last = readiness.last
        return JSONResponse(
            {"live": True, "ready_generative_models": list(last.ready_generative_models) if last else []}
        )

    async def readyz(request: Request) -> Response:
        report = await readiness.check()
        model = request.query_params.get("model")
        ready = report.serves(model) if model else report.ready
        return JSONResponse(report.as_dict(), status_code=200 if ready else 503)

    async def healthz(request: Request) -> Response:
        report = await readiness.check()
        return JSONResponse(
            {"live": True, **report.as_dict(), "inflight": dispatcher.inflight, "shares": dispatcher.shares()}
        )

    async def health_live(request: Request) -> Response:
        return Response(status_code=200)

    async def health_ready(request: Request) -> Response:
        return Response(status_code=200 if (await readiness.check()).ready else 503)

    async def server_metadata(request: Request) -> Response:
        return JSONResponse({"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": EXTENSIONS})

    async def model_metadata(request: Request) -> Response:
        await authorize(request, INFER)
        view = await catalog.model(request.path_params["model"])
        signature = with_generative_tensors(view, await catalog.signature(view.name))

        def listed(specs: Any) -> list[dict[str, Any]]:
            return [
                {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
                for t in tensor_metadata(specs)
            ]

        return JSONResponse(
            {
                "name": view.name,
                "versions": ["1"],
                "platform": view.backend or signature.backend,
                "inputs": listed(signature.inputs),
                "outputs": listed(signature.outputs),
            }
        )

    async def model_ready(request: Request) -> Response:
        view = await catalog.model(request.path_params["model"])
        return Response(status_code=200 if view.ready else 503)

    async def model_config(request: Request) -> Response:
        await authorize(request, INFER)
        view = await catalog.model(request.path_params["model"])
        return JSONResponse(
            {"name": view.name, "platform": view.backend, "backend": view.backend, "max_batch_size": 0}
        )

    async def model_stats(request: Request) -> Response:
        await authorize(request, INFER)
        name = request.path_params.get("model", "")
        if name:
            await catalog.model(name)  # NotFoundError for an unknown model
        stats = await statistics.model_statistics(name)
        if name and not stats:
            stats = [empty_v2(name)]
        return JSONResponse({"model_stats": stats})

    async def repository_index(request: Request) -> Response:
        await authorize(request, INFER)
        ready_only = False
        raw = bytes(await read_body(request, limits.max_envelope_bytes))
        if raw.strip():
            parsed = parse_json_object(raw)
            ready_only = bool(parsed.get("ready", False))
        views = (await catalog.models()).values()
        return JSONResponse(
            [
                {"name": v.name, "version": "1", "state": v.state, "reason": v.reason}
                for v in views
                if v.ready or not ready_only
            ]
        )

    async def repository_load(request: Request) -> Response:
        await authorize(request, ADMIN)
        await catalog.load(request.path_params["model"])
        return Response(status_code=200)

    async def repository_unload(request: Request) -> Response:
        await authorize(request, ADMIN)
        await catalog.unload(request.path_params["model"])
        return Response(status_code=200)

    def prepare(
        body: bytes | memoryview, header_length: str | None, **call: Any
    ) -> tuple[ParsedInfer, InferenceCall]:
        """Body -> parsed request and call: costs time in proportion to the body."""
        parsed = parse_infer(body, header_length, limits)
        check_parameters(parsed.parameters, limits)
        return parsed, build_call(
            parsed.inputs,
            priority=parse_priority(parsed.parameters.get("priority")),
            timeout_ms=parse_timeout_ms(parsed.parameters.get("timeout")),
            limits=limits,
            **call,
        )

    async def infer(request: Request) -> Response:
        client = await authorize(request, INFER)
        hints = hints_from(request.headers)  # X-Loadmaster-*: where the v2 parameters say nothing
        model_name = request.path_params["model"]
        header_length = request.headers.get(HEADER_LENGTH)
        # The JSON part is bounded on its own; binary tensor data may follow it up to the payload limit.
        limit = limits.max_json_bytes + (limits.max_payload_bytes if header_length is not None else 0)
        body = await read_body(request, limit)
        ids_and_client = {"model_id": model_name, "request_id": next(ids), "client_id": client or "http"}
        if len(body) > INLINE_BODY_BYTES:
            parsed, call = await off_loop(prepare, body, header_length, **ids_and_client)
        else:
            parsed, call = prepare(body, header_length, **ids_and_client)
        del body  # the call holds what it needs: a refused request's buffers go with its reply
        _apply_hints(call, parsed.parameters, hints)
        try:  # tensors, or text_input
            result = await unless_client_leaves(request, generative.answer(dispatcher, call))
        except ClientGone:  # dispatch() cancelled the request in the dispatcher
            return Response(status_code=499)
        outputs = outputs_of(result, parsed.outputs.keys())
        encode = functools.partial(
            encode_response_parts,
            model_name=model_name,
            request_id=parsed.id,
            outputs=outputs,
            binary=parsed.outputs,
            binary_default=parsed.binary_default,
        )
        if json_encoding_bytes(outputs, parsed.outputs, parsed.binary_default) > INLINE_BODY_BYTES:
            head, blobs = await off_loop(encode)  # values turned to JSON: time grows with the outputs
        else:
            head, blobs = encode()
        return _infer_response(head, blobs)

    def route(path: str, handler: Handler, methods: tuple[str, ...] = ("GET",)) -> Route:
        async def endpoint(request: Request) -> Response:
            try:
                version = request.path_params.get("version")
                if version is not None and version != MODEL_VERSION:
                    raise NotFoundError(
                        f"model '{request.path_params.get('model', '')}' has no version '{version}' "
                        f"(models are served at version {MODEL_VERSION})"
                    )
                with tracing.incoming_context(request.headers):
                    return await handler(request)
            except Exception as error:  # the one place errors become HTTP statuses
                response = await _error_response(request, error)
                # The error's traceback holds the failed handler's frames, and they hold it
                # (and the request body) in a cycle: cut it, so the body goes with the reply
                # instead of waiting for a garbage collection.
                error.__traceback__ = error.__context__ = error.__cause__ = None
                return response

        return Route(path, endpoint, methods=list(methods))

    model = "/v2/models/{model}"
    versioned = "/v2/models/{model}/versions/{version}"
    routes: list[BaseRoute] = [
        route("/livez", livez),
        route("/readyz", readyz),
        route("/healthz", healthz),
        route("/v2/health/live", health_live),
        route("/v2/health/ready", health_ready),
        route("/v2", server_metadata),
        route("/v2/models/stats", model_stats),
        route("/v2/repository/index", repository_index, ("POST",)),
        route("/v2/repository/models/{model}/load", repository_load, ("POST",)),
        route("/v2/repository/models/{model}/unload", repository_unload, ("POST",)),
    ]
    for prefix in (model, versioned):
        routes += [
            route(prefix, model_metadata),
            route(prefix + "/ready", model_ready),
            route(prefix + "/config", model_config),
            route(prefix + "/stats", model_stats),
            route(prefix + "/infer", infer, ("POST",)),
        ]
    openai = openai_routes(
        generations, auth, gateway_id=gateway_id, policy=policy, max_n=settings.max_n, images=images
    )
    # The other dialects (docs/dialects.md) on the same plane: Anthropic's /v1/models answers
    # requests carrying `anthropic-version` and hands the rest to OpenAI's, so it goes first.
    endpoints = {route.path: route.endpoint for route in openai}

    def calls(client_type: str) -> DialectCalls:
        return DialectCalls(generations, auth, policy, images=images, client_type=client_type)

    routes += anthropic_routes(
        calls("anthropic"),
        models=generations.models,
        openai_models=endpoints["/v1/models"],
        openai_model=endpoints["/v1/models/{model:path}"],
        gateway_id=gateway_id,
        max_body_bytes=limits.max_json_bytes,
    )
    routes += openai
    routes += ollama_routes(
        calls("ollama"),
        auth,
        models=generations.models,
        views=catalog.models,
        load=catalog.load,
        unload=catalog.unload,
        gateway_id=gateway_id,
        max_body_bytes=limits.max_json_bytes,
        embedder=embedder,
    )
    routes += extra_routes  # the image API, openpi, admin: wired in server.py
    middleware = []
    if settings.cors_origins:  # browsers: preflights answered, other origins refused
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=settings.cors_origins,
                allow_methods=["GET", "POST", "HEAD", "OPTIONS", "DELETE"],
                allow_headers=["*"],
                expose_headers=["X-Loadmaster-Model", "Retry-After"],
                max_age=600,
            )
        )
    return Starlette(routes=routes, middleware=middleware)


def _apply_hints(call: InferenceCall, parameters: dict[str, Any], hints: RequestHints) -> None:
    if hints.priority is not None and "priority" not in parameters:
        call.priority = hints.priority
    if hints.deadline_ms is not None and "timeout" not in parameters:
        call.timeout_ms = hints.deadline_ms
    if hints.urgency is not None:
        call.urgency = hints.urgency
    if hints.client_id is not None:
        call.client_id = hints.client_id


def _infer_response(head: bytes, blobs: list[memoryview]) -> Response:
    """The infer response: the JSON header, then any binary data. Small binary data is joined to
    the header; large data is streamed chunk by chunk from the views (flow-controlled by the
    transport), so the reply is neither copied whole nor held in several copies at once."""
    if not blobs:
        return Response(head, media_type="application/json")
    headers = {"Inference-Header-Content-Length": str(len(head))}
    size = sum(blob.nbytes for blob in blobs)
    if size <= STREAM_REPLY_BYTES:
        return Response(b"".join([head, *blobs]), media_type="application/octet-stream", headers=headers)
    headers["Content-Length"] = str(len(head) + size)

    async def chunks() -> AsyncIterator[bytes]:
        yield head
        for blob in blobs:
            for start in range(0, blob.nbytes, REPLY_CHUNK_BYTES):
                yield blob[start : start + REPLY_CHUNK_BYTES].tobytes()
        blobs.clear()  # the worker's reply frame goes as soon as the last chunk is out

    return StreamingResponse(chunks(), media_type="application/octet-stream", headers=headers)


def parse_json_object(raw: bytes | memoryview) -> dict[str, Any]:
    try:
        value = json.loads(bytes(raw))
    except (ValueError, RecursionError):
        raise InvalidArgumentError("request body is not JSON") from None
    if not isinstance(value, dict):
        raise InvalidArgumentError("request body must be a JSON object")
    return value


class HttpFrontend:
    """Serves the app with uvicorn on the gateway's event loop."""

    def __init__(
        self,
        app: Starlette,
        *,
        host: str,
        port: int,
        header_timeout_s: float = 10.0,
        keep_alive_s: float = 5.0,
        ws_max_size: int = 16 << 20,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
    ) -> None:
        protocol = type(
            "HeaderTimedH11Protocol", (HeaderTimedH11Protocol,), {"header_timeout_s": header_timeout_s}
        )
        self._config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            http=protocol,
            timeout_keep_alive=max(1, round(keep_alive_s)),
            # WebSockets (openpi, frontends/openpi.py): frames up to a request's limits, never
            # compressed (openpi's client asks for none; a deflate bomb has no limit of its own).
            ws_max_size=ws_max_size,
            ws_per_message_deflate=False,
            # websockets' sans-I/O protocol: measured a steadier p50 than its legacy asyncio one
            # (bench/robot_clients.py, docs/robot-clients.md), and it is the maintained API.
            ws="websockets-sansio",
            ssl_certfile=tls_cert_file,
            ssl_keyfile=tls_key_file,
        )
        self._server = uvicorn.Server(self._config)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.port = port

    async def start(self) -> None:
        if not self._config.loaded:
            self._config.load()
        self._server.lifespan = self._config.lifespan_class(self._config)
        try:
            await self._server.startup()
        except SystemExit:  # uvicorn exits when it cannot bind
            raise RuntimeError(
                f"HTTP front end could not bind {self._config.host}:{self._config.port}"
            ) from None
        sockets = [sock for server in self._server.servers for sock in server.sockets]
        if sockets:
            self.port = sockets[0].getsockname()[1]
        self._task = asyncio.create_task(main_loop(self._server, self._stop), name="http-serve")
        log.info("HTTP front end listening on %s:%d", self._config.host, self.port)

    async def close(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        self._stop.set()
        await asyncio.gather(self._task, return_exceptions=True)
        self._server.force_exit = True  # do not wait for idle keep-alive connections
        await self._server.shutdown()
        self._task = None


class HeaderTimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers have not all arrived
    `header_timeout_s` after it opened or after its last response (uvicorn times out only idle
    keep-alive connections, so a client sending a header byte at a time held one forever).
    A client that sent part of a request is answered 408 first."""

    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return  # a request is in (its body has a timeout of its own), or it is gone
        if self.conn.trailing_data[0]:
            self.transport.write(_REQUEST_TIMEOUT)
        self.transport.close()


_REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
