"""Who may read the metrics HTTP endpoints: the gateway's API keys (`gateway.auth.api_keys`),
any scope, when any are configured; otherwise everyone (docs/security.md).

A key is sent as `Authorization: Bearer <key>` (scripts, Prometheus' `authorization`) or as the
password of HTTP Basic auth (a browser asks for it on the 401 and sends it with the
dashboard's own requests). `/healthz` stays open for probes. A refusal is logged with the
caller's address."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
from collections.abc import Sequence

from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp

from loadmaster.common.gateway_config import ApiKeySettings

__all__ = ["ApiKeyGuard", "presented_key"]

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/healthz"})


def presented_key(header: str | None) -> str | None:
    """The key of a `Bearer <key>` or `Basic base64(user:key)` Authorization value."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer":
        return value or None
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2] or None
    return None


class ApiKeyGuard(BaseHTTPMiddleware):
    def __init__(self, app: ASGIApp, *, keys: Sequence[ApiKeySettings]) -> None:
        super().__init__(app)
        self._digests = [bytes.fromhex(key.sha256) for key in keys]

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        if not self._digests or request.url.path in OPEN_PATHS:
            return await call_next(request)
        key = presented_key(request.headers.get("authorization"))
        if key is not None:
            digest = hashlib.sha256(key.encode()).digest()
            if any(hmac.compare_digest(digest, known) for known in self._digests):
                return await call_next(request)
        peer = request.client.host if request.client else "unknown"
        log.warning(
            "refused %s %s from %s: %s",
            request.method,
            request.url.path,
            peer,
            "no API key" if key is None else "API key not valid",
        )
        return JSONResponse(
            {"error": "an API key is required (Authorization: Bearer <key>, or as the Basic password)"},
            status_code=401,
            headers={"WWW-Authenticate": 'Basic realm="loadmaster metrics"'},
        )
