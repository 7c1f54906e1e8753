"""What the OpenAI-compatible route modules share (chat and completions, images,
embeddings; the Ollama and Anthropic dialects too): reading a bounded body, a route whose
errors become one API's answers, and answering an error in OpenAI's shape with its status
and `Retry-After`."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loadmaster.common.errors import InternalError, LoadmasterError, retry_after_header
from loadmaster.gateway.frontends.openai_schema import OpenAIError, error_from

__all__ = ["MAX_BODY_BYTES", "api_route", "error_response", "read_body"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20  # a chat body is text: far below the tensor payload limit


def error_response(error: Exception) -> Response:
    if isinstance(error, OpenAIError):
        return JSONResponse(error.body(), status_code=error.status)
    if not isinstance(error, LoadmasterError):
        log.error("unhandled error in the OpenAI API", exc_info=error)
        error = InternalError(f"internal error: {type(error).__name__}")
    mapped = error_from(error)
    retry_after = retry_after_header(error)  # 429 and 503: when to come back
    headers = {"Retry-After": retry_after} if retry_after is not None else None
    retry_after_s = getattr(error, "retry_after_s", None)
    if headers is not None and isinstance(retry_after_s, int | float):  # a cooldown knows it exactly
        headers["retry-after-ms"] = str(math.ceil(retry_after_s * 1000))
    return JSONResponse(mapped.body(), status_code=mapped.status, headers=headers)


def api_route(
    path: str,
    handler: Callable[[Request], Awaitable[Response]],
    methods: list[str],
    answer: Callable[[Exception], Response] = error_response,
) -> Route:
    """A route whose handler's errors become `answer(error)`: the one place an API's errors
    become statuses (OpenAI's shape by default; the dialects pass their own)."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as error:
            return answer(error)

    return Route(path, endpoint, methods=methods)


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body, at most `limit` bytes (else 413)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise OpenAIError(413, f"request body of {declared} bytes exceeds the limit of {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise OpenAIError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
