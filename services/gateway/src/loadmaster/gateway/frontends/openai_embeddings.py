"""`POST /v1/embeddings` in OpenAI's shapes: translation only.

A body (`model`, `input` as a string, a list of strings, a list of token ids or a list of
lists of token ids; `encoding_format` float or base64; `dimensions`; `user`; Loadmaster's
`x_client_id`, `x_priority`, `x_deadline_ms`) becomes an `EmbeddingRequest` (embeddings.py),
or a 400 naming the field: an empty string or list, more than MAX_INPUTS inputs, an unknown
`encoding_format`. The model refuses what it cannot do itself: a `dimensions` it does not
make, an input longer than it takes, a token id outside its vocabulary (each a 400 naming it).

The reply is `{"object": "list", "data": [{"object": "embedding", "index", "embedding"}...],
"model", "usage": {"prompt_tokens", "total_tokens"}}`; with base64 each vector is its
little-endian float32 bytes in base64, as OpenAI's own. The JSON (or base64) of many long
vectors is made on the validation threads, off the event loop. A client that disconnects
cancels its call. The API keys (or OIDC tokens), scopes and rate limits apply (`infer`).
"""

from __future__ import annotations

import base64
import itertools
import json
from typing import Any, Literal

import numpy as np
from pydantic import Field, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loadmaster.gateway.auth import INFER, Authenticator, bearer_token
from loadmaster.gateway.embeddings import Embedder, EmbeddingRequest, EmbeddingResult
from loadmaster.gateway.frontends.disconnects import ClientGone, unless_client_leaves
from loadmaster.gateway.frontends.openai_common import api_route, read_body
from loadmaster.gateway.frontends.openai_schema import OpenAIBody, OpenAIError, invalid, load_json
from loadmaster.gateway.frontends.request_headers import hints_from, with_hints
from loadmaster.gateway.validation import off_loop

__all__ = ["MAX_INPUTS", "EmbeddingsBody", "embedding_routes", "parse_embeddings", "render_embeddings"]

MAX_INPUTS = 2048  # OpenAI's limit per request
_TOKEN_ID_MAX = (1 << 32) - 1


class EmbeddingsBody(OpenAIBody):
    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    x_client_id: str | None = Field(default=None, max_length=256)
    x_priority: int | None = Field(default=None, ge=0, le=255)
    x_deadline_ms: float | None = Field(default=None, gt=0.0)


def parse_embeddings(raw: bytes) -> tuple[EmbeddingRequest, bool]:
    """A body -> (request, whether vectors go back as base64), or `OpenAIError` 400."""
    try:
        body = EmbeddingsBody.model_validate(load_json(raw))
    except ValidationError as error:
        raise invalid(error) from None
    value = body.input
    inputs: list[str | tuple[int, ...]]
    if isinstance(value, str):
        inputs = [value]
    elif value and all(isinstance(item, int) for item in value):
        inputs = [tuple(value)]  # type: ignore[arg-type]
    else:
        inputs = [item if isinstance(item, str) else tuple(item) for item in value]  # type: ignore[union-attr]
    if not inputs:
        raise OpenAIError(400, "input: at least one input is required", param="input")
    if len(inputs) > MAX_INPUTS:
        raise OpenAIError(
            400, f"input: {len(inputs)} inputs, at most {MAX_INPUTS} per request", param="input"
        )
    for index, item in enumerate(inputs):
        if not item:
            raise OpenAIError(400, f"input[{index}]: empty (an input needs text or token ids)", param="input")
        if not isinstance(item, str) and any(not 0 <= token <= _TOKEN_ID_MAX for token in item):
            raise OpenAIError(
                400, f"input[{index}]: token ids are integers 0..{_TOKEN_ID_MAX}", param="input"
            )
    request = EmbeddingRequest(
        model=body.model,
        inputs=tuple(inputs),
        dimensions=body.dimensions,
        priority=body.x_priority,
        deadline_ms=body.x_deadline_ms,
        client_id=body.x_client_id,
        user=body.user,
    )
    return request, body.encoding_format == "base64"


def render_embeddings(model: str, result: EmbeddingResult, *, base64_vectors: bool) -> str:
    """The response body's JSON text (grows with the inputs: run it off the loop)."""
    vectors = np.ascontiguousarray(result.vectors, dtype="<f4")
    data: list[dict[str, Any]] = []
    for index, vector in enumerate(vectors):
        encoded: Any = (
            base64.b64encode(vector.tobytes()).decode("ascii") if base64_vectors else vector.tolist()
        )
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return json.dumps({"object": "list", "data": data, "model": model, "usage": usage}, separators=(",", ":"))


def embedding_routes(embedder: Embedder, auth: Authenticator, *, gateway_id: str) -> list[Route]:
    ids = (f"emb-{gateway_id}-{n}" for n in itertools.count(1))

    async def embeddings(request: Request) -> Response:
        key_name = (await auth.authenticate(bearer_token(request.headers.get("authorization")), INFER)).name
        embedding_request, base64_vectors = await off_loop(parse_embeddings, await read_body(request))
        embedding_request = with_hints(embedding_request, hints_from(request.headers))  # X-Loadmaster-*
        client_id = embedding_request.client_id or embedding_request.user or key_name or "openai"
        work = embedder.embed(embedding_request, request_id=next(ids), client_id=client_id)
        try:
            vectors = await unless_client_leaves(request, work)
        except ClientGone:  # cancelling the await cancelled the call
            return Response(status_code=499)
        body = await off_loop(
            render_embeddings, embedding_request.model, vectors, base64_vectors=base64_vectors
        )
        return Response(
            body, media_type="application/json", headers={"X-Loadmaster-Model": embedding_request.model}
        )

    return [api_route("/v1/embeddings", embeddings, ["POST"])]
