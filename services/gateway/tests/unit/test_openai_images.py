"""The image API's request validation and reply shapes (frontends/openai_images.py): no I/O."""

from __future__ import annotations

import base64
import json

import pytest

from loadmaster.common.errors import ExpiredError, InvalidArgumentError
from loadmaster.common.gateway_config import ImagesSettings
from loadmaster.gateway.frontends.openai_images import (
    DEFAULT_SIZE,
    job_error,
    parse_image_request,
    render_images,
)
from loadmaster.gateway.frontends.openai_schema import OpenAIError
from loadmaster.gateway.images import ImageRequest

SETTINGS = ImagesSettings(sizes=["64x64", "128x128", "256x256", "512x256"], max_n=4)


def parse(**body: object) -> tuple[ImageRequest, bool]:
    return parse_image_request(json.dumps({"model": "m", "prompt": "a cat", **body}).encode(), SETTINGS)


def refused(**body: object) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        parse(**body)
    assert caught.value.status == 400
    return caught.value


def test_a_full_body_becomes_the_request() -> None:
    request, run_async = parse(
        n=3, size="512x256", x_seed=7, x_priority=0, user="u", response_format="b64_json"
    )
    assert (request.model, request.prompt, request.n, request.width, request.height) == (
        "m",
        "a cat",
        3,
        512,
        256,
    )
    assert (request.seed, request.priority, request.user, request.size) == (7, 0, "u", "512x256")
    assert run_async is False
    assert ImageRequest.from_dict(json.loads(json.dumps(request.as_dict()))) == request


def test_defaults_one_image_of_the_default_size_synchronously() -> None:
    request, run_async = parse()
    assert (request.n, request.size, run_async) == (1, DEFAULT_SIZE, False)
    assert parse(size="auto")[0].size == DEFAULT_SIZE
    assert parse(x_async=True)[1] is True


@pytest.mark.parametrize("size", ["1024x1024", "100x100", "64", "64x64x3", "0x64", "sixty", "", "-64x64"])
def test_an_unsupported_size_is_a_400_naming_size(size: str) -> None:
    error = refused(size=size)
    assert error.param == "size" and "size" in error.message and "64x64" in error.message


@pytest.mark.parametrize("n", [0, -1, 5, 100])
def test_n_out_of_range_is_a_400_naming_n(n: int) -> None:
    error = refused(n=n)
    assert error.param == "n" and "between 1 and 4" in error.message


def test_a_url_response_format_is_refused_clearly() -> None:
    error = refused(response_format="url")
    assert error.param == "response_format" and "b64_json" in error.message
    assert refused(output_format="jpeg").param == "output_format"


@pytest.mark.parametrize(
    ("body", "param"),
    [({"prompt": ""}, "prompt"), ({"model": ""}, "model"), ({"n": "two"}, "n"), ({"x_seed": -1}, "x_seed")],
)
def test_bad_fields_name_themselves(body: dict[str, object], param: str) -> None:
    assert refused(**body).param == param


def test_missing_fields_and_broken_json() -> None:
    with pytest.raises(OpenAIError) as caught:
        parse_image_request(b'{"model": "m"}', SETTINGS)
    assert caught.value.param == "prompt" and "required" in caught.value.message
    with pytest.raises(OpenAIError) as caught:
        parse_image_request(b"{not json", SETTINGS)
    assert caught.value.status == 400 and "JSON" in caught.value.message
    with pytest.raises(OpenAIError) as caught:  # nested deeper than the parser goes
        parse_image_request(b"[" * 100_000, SETTINGS)
    assert caught.value.status == 400 and "JSON" in caught.value.message


def test_render_is_openai_images_response_with_b64_pngs() -> None:
    request, _ = parse(n=2, size="64x64")
    body = json.loads(render_images(request, [b"\x89PNG-one", b"\x89PNG-two"], 1234))
    assert body["created"] == 1234 and body["output_format"] == "png" and body["size"] == "64x64"
    assert [base64.b64decode(item["b64_json"]) for item in body["data"]] == [b"\x89PNG-one", b"\x89PNG-two"]


def test_a_failed_job_keeps_the_status_and_shape_of_the_error() -> None:
    assert job_error(InvalidArgumentError("size 1x1 is not supported")) == {
        "message": "size 1x1 is not supported",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_argument",
        "status": 400,
    }
    assert job_error(ExpiredError("deadline passed"))["status"] == 504
    assert job_error(OpenAIError(400, "n: bad", param="n"))["param"] == "n"
