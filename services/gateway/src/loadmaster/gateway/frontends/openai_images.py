"""`POST /v1/images/generations` and `GET /v1/jobs/{id}`, in OpenAI's shapes: translation only.

A body (OpenAI's image request: `model`, `prompt`, `n`, `size`, `response_format`, `user`;
Loadmaster's `x_seed`, `x_async`, `x_priority`, `x_deadline_ms`, `x_client_id`) becomes an
`ImageRequest`, or a 400 naming the field: `size` must be one of `gateway.images.sizes`
(the model may accept fewer: its own 400 names the size), `n` 1..`max_n`, and only
`b64_json` comes back (`response_format: url` is refused: nothing here serves files).

The reply is `{"created", "data": [{"b64_json"}...], "output_format": "png", "size"}`. With
`x_async: true` the reply is 202 and a job (`{"id", "object": "image.generation.job",
"status": "queued", ...}`); `GET /v1/jobs/{id}` returns it with its `status` (queued, running,
succeeded, failed) and, once finished, its `result` (the body above) or `error`, until
`job_ttl_s` after it finished. Only the API key (or client) that submitted a job reads it.
Base64 and JSON of the images are made on the validation threads, off the event loop.
"""

from __future__ import annotations

import base64
import itertools
import json
import re
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loadmaster.common.errors import InvalidArgumentError, LoadmasterError, UnavailableError
from loadmaster.common.gateway_config import ImagesSettings
from loadmaster.gateway.auth import INFER, Authenticator, bearer_token
from loadmaster.gateway.frontends.disconnects import ClientGone, unless_client_leaves
from loadmaster.gateway.frontends.openai_common import api_route, read_body
from loadmaster.gateway.frontends.openai_schema import OpenAIError, error_from, load_json
from loadmaster.gateway.image_jobs import ImageJobs
from loadmaster.gateway.images import ImageGenerator, ImageRequest
from loadmaster.gateway.jobs import Job
from loadmaster.gateway.validation import off_loop

__all__ = ["DEFAULT_SIZE", "ImageBody", "image_routes", "job_error", "parse_image_request", "render_images"]

DEFAULT_SIZE = "256x256"  # when `size` is left out or "auto"
_SIZE = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")


class ImageBody(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)  # OpenAI's other fields are ignored

    model: str = Field(min_length=1)
    prompt: str = Field(min_length=1, max_length=32_000)
    n: int | None = None
    size: str | None = None
    response_format: str | None = None
    output_format: str | None = None
    user: str | None = None
    x_seed: int | None = Field(default=None, ge=0, lt=1 << 63)
    x_async: bool = False
    x_client_id: str | None = Field(default=None, max_length=256)
    x_priority: int | None = Field(default=None, ge=0, le=255)
    x_deadline_ms: float | None = Field(default=None, gt=0.0)


def _invalid(error: ValidationError) -> OpenAIError:
    first = error.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    if first["type"] == "missing":
        return OpenAIError(400, f"'{param}' is a required property", param=param)
    return OpenAIError(400, f"{param}: {first['msg']}" if param else str(first["msg"]), param=param)


def parse_image_request(raw: bytes, settings: ImagesSettings) -> tuple[ImageRequest, bool]:
    """A body -> (request, whether it runs as an async job), or `OpenAIError` 400 naming the field."""
    try:
        body = ImageBody.model_validate(load_json(raw))
    except ValidationError as error:
        raise _invalid(error) from None
    n = 1 if body.n is None else body.n
    if not 1 <= n <= settings.max_n:
        raise OpenAIError(400, f"n: {n} images asked; between 1 and {settings.max_n} per request", param="n")
    size = DEFAULT_SIZE if body.size in (None, "auto") else body.size
    match = _SIZE.match(size or "")
    if match is None or size not in settings.sizes:
        raise OpenAIError(
            400,
            f"size: {size!r} is not supported; supported sizes: {', '.join(settings.sizes)}",
            param="size",
        )
    if body.response_format not in (None, "b64_json"):
        raise OpenAIError(
            400,
            f"response_format: {body.response_format!r} is not supported; images come back inline "
            "as 'b64_json' (Loadmaster serves no image URLs)",
            param="response_format",
        )
    if body.output_format not in (None, "png"):
        raise OpenAIError(
            400, f"output_format: {body.output_format!r} is not supported; only 'png'", param="output_format"
        )
    request = ImageRequest(
        model=body.model,
        prompt=body.prompt,
        n=n,
        width=int(match.group(1)),
        height=int(match.group(2)),
        seed=body.x_seed,
        priority=body.x_priority,
        deadline_ms=body.x_deadline_ms,
        client_id=body.x_client_id,
        user=body.user,
    )
    return request, body.x_async


def render_images(request: ImageRequest, images: list[bytes], created: int) -> str:
    """The response body's JSON text (base64 grows with the images: run it off the loop)."""
    body = {
        "created": created,
        "data": [{"b64_json": base64.b64encode(png).decode("ascii")} for png in images],
        "output_format": "png",
        "size": request.size,
        "model": request.model,
    }
    return json.dumps(body, separators=(",", ":"))


def job_error(error: Exception) -> dict[str, Any]:
    """A failed job's `error`: OpenAI's error object plus the HTTP status it would have had."""
    mapped = error if isinstance(error, OpenAIError) else error_from(_as_loadmaster(error))
    return {**mapped.body()["error"], "status": mapped.status}


def _as_loadmaster(error: Exception) -> LoadmasterError:
    return error if isinstance(error, LoadmasterError) else InvalidArgumentError(str(error))


def _job_view(job: Job) -> str:
    """The `GET /v1/jobs/{id}` body; a result's JSON text is spliced in, never parsed."""
    view: dict[str, Any] = {
        "id": job.job_id,
        "object": f"{job.kind}.generation.job",
        "status": job.state.value,
        "created": int(job.created_s),
        "model": job.request.get("model", ""),
        "attempts": job.attempts,
    }
    if job.finished_s is not None:
        view["finished_at"] = int(job.finished_s)
    if job.expires_in_s is not None and job.finished_s is not None:
        view["expires_at"] = int(time.time() + job.expires_in_s)
    if job.error is not None:
        view["error"] = job.error
    head = json.dumps(view, separators=(",", ":"))
    if job.result_json is None:
        return head
    return head[:-1] + ',"result":' + job.result_json + "}"


def image_routes(
    generator: ImageGenerator,
    jobs: ImageJobs | None,
    auth: Authenticator,
    settings: ImagesSettings,
    *,
    gateway_id: str,
    clock: Callable[[], float] = time.time,
) -> list[Route]:
    ids = (f"img-{gateway_id}-{n}" for n in itertools.count(1))

    async def render(request: ImageRequest, images: list[bytes], created: int) -> str:
        return await off_loop(render_images, request, images, created)

    async def generations(request: Request) -> Response:
        key_name = (await auth.authenticate(bearer_token(request.headers.get("authorization")), INFER)).name
        image_request, run_async = parse_image_request(await read_body(request), settings)
        client_id = image_request.client_id or image_request.user or key_name or "openai"
        if run_async:
            if jobs is None:
                raise UnavailableError(
                    "async image jobs need Redis: set redis_url (or REDIS_URL) on the gateway"
                )
            job = await jobs.submit(image_request, client=key_name)
            return Response(_job_view(job), status_code=202, media_type="application/json")
        created = int(clock())
        work = generator.generate(image_request, request_id=next(ids), client_id=client_id)
        try:
            images = await unless_client_leaves(request, work)
        except ClientGone:  # cancelling the await cancelled the request
            return Response(status_code=499)
        body = await render(image_request, images, created)
        return Response(
            body, media_type="application/json", headers={"X-Loadmaster-Model": image_request.model}
        )

    async def get_job(request: Request) -> Response:
        key_name = (await auth.authenticate(bearer_token(request.headers.get("authorization")), INFER)).name
        if jobs is None:
            raise UnavailableError("async jobs need Redis: set redis_url (or REDIS_URL) on the gateway")
        job_id = request.path_params["job_id"]
        job = await jobs.get(job_id)
        if job is None or job.client != key_name:  # with API keys, a key reads only its own jobs
            raise OpenAIError(
                404,
                f"job '{job_id}' not found (a finished job is kept {settings.job_ttl_s:g} s)",
                param="job_id",
                code="not_found",
            )
        return Response(_job_view(job), media_type="application/json")

    return [
        api_route("/v1/images/generations", generations, ["POST"]),
        api_route("/v1/jobs/{job_id}", get_job, ["GET"]),
    ]
