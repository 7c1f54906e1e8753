"""What the metrics HTTP server (`http._EmbeddedServer`) and `loadmaster.common.http_server.main_loop`
(also the gateway's HTTP front end) assume of uvicorn beyond its documented API, checked
against the installed version; the metrics and gateway pyprojects pin the versions this
passed on. Fails when an upgrade changes one of them:

- `Server.serve` installs its signal handlers through `capture_signals()` (overridden to do
  nothing: the gRPC server owns SIGTERM/SIGINT) and runs `main_loop()` between `startup` and
  `shutdown` (overridden to tick once a second);
- `on_tick(counter)` refreshes the Date header when `counter % 10 == 0` and answers
  `should_exit`; other ticks only answer;
- `startup()` and `shutdown()` can run without `serve()` once `lifespan` is set (the gateway).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import signal

import uvicorn
from starlette.applications import Starlette

from loadmaster.common.http_server import main_loop
from loadmaster.metrics.http import _EmbeddedServer


def _server(kind: type[uvicorn.Server] = uvicorn.Server) -> uvicorn.Server:
    config = uvicorn.Config(Starlette(), lifespan="off", log_config=None)
    config.load()
    return kind(config)


def test_serve_wraps_its_run_in_capture_signals_and_runs_main_loop_between_startup_and_shutdown() -> None:
    serve = inspect.getsource(uvicorn.Server.serve)
    assert "with self.capture_signals():" in serve
    run = inspect.getsource(uvicorn.Server._serve)
    assert (
        run.index("await self.startup(")
        < run.index("await self.main_loop()")
        < run.index("await self.shutdown(")
    )
    assert isinstance(uvicorn.Server.capture_signals(_server()), contextlib.AbstractContextManager)


def test_startup_and_shutdown_run_alone_once_lifespan_is_set_as_serve_sets_it() -> None:
    """The gateway's HTTP front end calls `startup()` and `shutdown()` itself, after setting
    `server.lifespan` the way `_serve` does."""
    run = inspect.getsource(uvicorn.Server._serve)
    assert "self.lifespan = config.lifespan_class(config)" in run
    assert "self.lifespan.startup()" in inspect.getsource(uvicorn.Server.startup)
    assert "sockets" in inspect.signature(uvicorn.Server.startup).parameters
    assert {"should_exit", "force_exit", "started"} <= vars(_server()).keys()


def test_the_embedded_server_leaves_signal_handlers_alone() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with _server(_EmbeddedServer).capture_signals():
        assert signal.getsignal(signal.SIGTERM) is before
    with uvicorn.Server.capture_signals(_server()):  # what the override keeps out
        assert signal.getsignal(signal.SIGTERM) is not before


async def test_on_tick_refreshes_the_date_header_every_tenth_tick_and_answers_should_exit() -> None:
    server = _server()
    assert await server.on_tick(5) is False
    assert server.server_state.default_headers == []  # not a tenth tick
    assert await server.on_tick(0) is False
    assert [name for name, _ in server.server_state.default_headers] == [b"date", b"server"]
    server.should_exit = True
    assert await server.on_tick(3) is True


async def test_main_loop_ends_when_stop_is_set_or_uvicorn_should_exit() -> None:
    server = _server()
    stop = asyncio.Event()
    task = asyncio.create_task(main_loop(server, stop))
    await asyncio.sleep(0)
    assert server.server_state.default_headers  # the first tick set the Date header
    stop.set()
    await asyncio.wait_for(task, 1.0)
    server.should_exit = True
    await asyncio.wait_for(main_loop(server, asyncio.Event()), 1.0)
