"""The HTTP side: `GET /metrics` (Prometheus) and `GET /healthz`, served by uvicorn in
the service's event loop. More routes (the dashboard) join through `create_app(routes=...)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Iterator, Sequence

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from loadmaster.common.gateway_config import ApiKeySettings
from loadmaster.common.http_server import main_loop
from loadmaster.metrics.access import ApiKeyGuard
from loadmaster.metrics.exposition import Exposition

__all__ = ["HttpServer", "create_app"]

log = logging.getLogger(__name__)


def create_app(
    exposition: Exposition,
    *,
    serving: Callable[[], bool] = lambda: True,
    routes: Sequence[BaseRoute] = (),
    api_keys: Sequence[ApiKeySettings] = (),
) -> Starlette:
    """The metrics HTTP app. `serving` answers `/healthz` (200 when True, else 503); with
    `api_keys`, every other path needs one of them (`access.ApiKeyGuard`)."""

    async def metrics(request: Request) -> Response:
        body, content_type = exposition.render(request.headers.get("accept", ""))
        return Response(body, media_type=content_type)

    async def healthz(request: Request) -> Response:
        ok = serving()
        return JSONResponse({"status": "SERVING" if ok else "NOT_SERVING"}, status_code=200 if ok else 503)

    return Starlette(
        routes=[
            Route("/metrics", metrics, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            *routes,
        ],
        middleware=[Middleware(ApiKeyGuard, keys=api_keys)],
    )


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers (the gRPC server owns SIGTERM/SIGINT), ticking once
    a second (`loadmaster.common.http_server`). It overrides undocumented `uvicorn.Server`
    methods: the pyproject pins uvicorn, tests/unit/test_uvicorn_internals.py checks them."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._stop = asyncio.Event()

    def request_exit(self) -> None:
        self.should_exit = True
        self._stop.set()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def main_loop(self) -> None:
        await main_loop(self, self._stop)


class HttpServer:
    """Runs an ASGI app with uvicorn as a task of the current event loop.

    The socket is bound in `start()`, so `port` is the real port (also when asked for
    port 0) and connections made right after `start()` wait in the backlog."""

    def __init__(self, app: Starlette, *, host: str, port: int, shutdown_timeout_s: float = 2.0) -> None:
        self._app = app
        self.host = host
        self._requested_port = port
        self._shutdown_timeout_s = shutdown_timeout_s
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None
        self.port: int | None = None

    async def start(self) -> None:
        if self._task is not None:
            return
        sock = _listen(self.host, self._requested_port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self._app,
            host=self.host,
            port=self.port,
            log_level="warning",
            log_config=None,  # keep the service's logging setup
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=int(self._shutdown_timeout_s) or 1,
        )
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="metrics-http")
        self._task.add_done_callback(self._on_done)
        log.info("serving HTTP on %s:%d", self.host, self.port)

    def _on_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("HTTP server failed", exc_info=task.exception())

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.request_exit()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), self._shutdown_timeout_s + 1.0)
        except TimeoutError:
            log.warning("HTTP server did not stop in time; cancelling it")
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        except Exception:  # already logged by _on_done
            pass
        self._server = None
        self._task = None


def _listen(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock
