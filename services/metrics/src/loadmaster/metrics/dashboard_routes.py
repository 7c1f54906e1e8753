"""The dashboard's HTTP routes: `GET /` (a static page), `GET /static/<file>` (its script and
style, shipped in this package: nothing is fetched from elsewhere) and `GET /api/dashboard`
(the JSON the page polls every second; see `dashboard.snapshot`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from loadmaster.metrics.dashboard import WorkerRow, snapshot
from loadmaster.metrics.windows import Windows

__all__ = ["dashboard_routes"]

_STATIC = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}


def _static(name: str) -> bytes:
    return resources.files("loadmaster.metrics").joinpath("static", name).read_bytes()


def _float_param(request: Request, name: str, default: float) -> float:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None


def dashboard_routes(
    windows: Windows,
    *,
    workers: Callable[[], Awaitable[list[WorkerRow] | None]],
    cache_s: float = 0.5,
) -> list[BaseRoute]:
    """The routes; documents are kept `cache_s` per query, so several open dashboards (and
    `loadmaster top`s) cost one computation (tens of ms with many busy models) per refresh."""
    index = _static("index.html")
    cached: dict[tuple[float, float, float], tuple[float, dict[str, Any]]] = {}
    files = {name: (_static(name), media) for name, media in _STATIC.items()}

    async def page(request: Request) -> Response:
        return Response(index, media_type="text/html; charset=utf-8", headers={"cache-control": "no-cache"})

    async def static(request: Request) -> Response:
        found = files.get(request.path_params["name"])
        if found is None:
            return Response("not found", status_code=404, media_type="text/plain")
        return Response(found[0], media_type=found[1], headers={"cache-control": "no-cache"})

    async def data(request: Request) -> Response:
        try:
            key = (
                _float_param(request, "window_s", 120.0),
                _float_param(request, "step_s", 1.0),
                _float_param(request, "summary_s", 10.0),
            )
            hit = cached.get(key)
            if hit is not None and windows.now() - hit[0] < cache_s:
                document = hit[1]
            else:
                rows = await workers()
                document = snapshot(windows, window_s=key[0], step_s=key[1], summary_s=key[2], workers=rows)
                if len(cached) > 16:  # a few distinct queries at most in practice
                    cached.clear()
                cached[key] = (windows.now(), document)
        except ValueError as error:
            return JSONResponse({"error": str(error)}, status_code=400)
        return JSONResponse(document, headers={"cache-control": "no-store"})

    return [
        Route("/", page, methods=["GET"]),
        Route("/static/{name}", static, methods=["GET"]),
        Route("/api/dashboard", data, methods=["GET"]),
    ]
