"""Images through the real suite (gateway -> scheduler -> model-pool worker -> diffusers engine)
with `tiny-diffusion`: the official `openai` client's `images.generate` and raw HTTP; bad
`size`, `n` and `response_format`; async jobs in Redis, across a gateway restart. With `tiny-sd`
(a text-conditioned Stable Diffusion pipeline): the prompt changes the image, a seed reproduces it.

Neither model is preloaded: the first test that uses one pays for its cold load."""

from __future__ import annotations

import base64
import io
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from loadmaster.cli.launcher import Suite

MODEL = "tiny-diffusion"


@pytest.fixture(scope="module")
def base_url(suite: Suite) -> Iterator[str]:
    gateway = suite.settings.gateway
    url = f"http://{gateway.http_host}:{gateway.http_port}/v1"
    warm = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    warm.images.generate(model=MODEL, prompt="warm up", size="64x64")  # the cold load
    yield url


@pytest.fixture()
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60)


def png(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    return image


def poll(base_url: str, job_id: str, *, until: set[str], timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        reply = httpx.get(f"{base_url}/jobs/{job_id}", timeout=10)
        assert reply.status_code == 200, reply.text
        job: dict[str, Any] = reply.json()
        if job["status"] in until:
            return job
        assert time.monotonic() < deadline, f"job {job_id} still {job['status']} after {timeout_s:.0f}s"
        time.sleep(0.1)


def submit(base_url: str, **body: Any) -> dict[str, Any]:
    reply = httpx.post(
        f"{base_url}/images/generations", json={"model": MODEL, "prompt": "a lighthouse", **body}, timeout=30
    )
    assert reply.status_code == 202, reply.text
    job: dict[str, Any] = reply.json()
    assert job["id"].startswith("imgjob-") and job["status"] == "queued"
    return job


def test_the_openai_client_gets_pngs_of_the_size_asked(client: openai.OpenAI) -> None:
    raw = client.images.with_raw_response.generate(
        model=MODEL, prompt="a red square", size="64x64", n=2, extra_body={"x_seed": 5}
    )
    reply = raw.parse()
    assert raw.headers["x-loadmaster-model"] == MODEL
    assert reply.data is not None and len(reply.data) == 2
    images = [png(item.b64_json or "") for item in reply.data]
    assert [image.size for image in images] == [(64, 64), (64, 64)]
    again = client.images.generate(
        model=MODEL, prompt="a red square", size="64x64", n=2, extra_body={"x_seed": 5}
    )
    assert again.data is not None and again.data[0].b64_json == reply.data[0].b64_json  # seeded


def test_tiny_sd_draws_the_prompt_and_the_same_seed_and_prompt_draw_the_same_image(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)  # a cold load first

    def draw(prompt: str, seed: int, **extra: Any) -> list[bytes]:
        reply = client.images.generate(
            model="tiny-sd", prompt=prompt, size="64x64", extra_body={"x_seed": seed}, **extra
        )
        assert reply.data is not None
        return [base64.b64decode(image.b64_json or "") for image in reply.data]

    lighthouse = draw("a lighthouse at dusk", 7)
    assert draw("a lighthouse at dusk", 7) == lighthouse  # same seed and prompt: the same PNG
    cat = draw("a red cat on a mat", 7)
    assert cat != lighthouse  # same seed, another prompt: another picture
    pixels = [
        np.asarray(Image.open(io.BytesIO(d[0])).convert("RGB"), dtype=np.int16) for d in (lighthouse, cat)
    ]
    assert np.abs(pixels[0] - pixels[1]).mean() > 0.1  # the picture changed, not a pixel or two
    assert draw("a lighthouse at dusk", 8) != lighthouse  # another seed, another picture
    two = client.images.generate(model="tiny-sd", prompt="a boat", size="256x256", n=2)
    assert two.data is not None and [png(image.b64_json or "").size for image in two.data] == [(256, 256)] * 2


def test_raw_http_gets_openais_shape(base_url: str) -> None:
    reply = httpx.post(
        f"{base_url}/images/generations",
        json={"model": MODEL, "prompt": "a boat", "size": "128x128", "response_format": "b64_json"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert isinstance(body["created"], int) and body["output_format"] == "png" and body["size"] == "128x128"
    assert [png(item["b64_json"]).size for item in body["data"]] == [(128, 128)]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"size": "100x100"}, "size"),
        ({"size": "huge"}, "size"),
        ({"n": 0}, "n"),
        ({"n": 11}, "n"),
        ({"response_format": "url"}, "response_format"),
    ],
)
def test_bad_fields_are_a_400_naming_them(client: openai.OpenAI, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.generate(model=MODEL, prompt="x", **fields)
    assert caught.value.status_code == 400
    body: Any = caught.value.body
    assert body["param"] == param and param in body["message"]


def test_a_size_the_gateway_takes_but_the_model_cannot_make_is_a_400_naming_size(
    client: openai.OpenAI, base_url: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.generate(model=MODEL, prompt="x", size="1024x1024")
    assert "size 1024x1024" in caught.value.message and "tiny-diffusion" in caught.value.message
    assert client.images.generate(
        model=MODEL, prompt="still serving", size="64x64"
    ).data  # and it keeps serving


def test_an_unknown_model_is_an_error_not_a_hang(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client.images.generate(model="no-such-model", prompt="x", size="64x64")
    assert caught.value.status_code in (404, 503)


def test_an_async_job_returns_an_id_at_once_then_its_result(base_url: str) -> None:
    job = submit(base_url, size="64x64", n=2, x_async=True)
    done = poll(base_url, job["id"], until={"succeeded", "failed"})
    assert done["status"] == "succeeded", done
    assert [png(item["b64_json"]).size for item in done["result"]["data"]] == [(64, 64)] * 2
    assert done["attempts"] == 1 and done["expires_at"] > time.time()
    failed = poll(
        base_url, submit(base_url, size="1024x1024", x_async=True)["id"], until={"succeeded", "failed"}
    )
    assert failed["status"] == "failed" and failed["error"]["status"] == 400
    assert "size 1024x1024" in failed["error"]["message"]
    missing = httpx.get(f"{base_url}/jobs/imgjob-nope", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "job_id"


def test_a_job_survives_a_gateway_restart_between_submit_and_poll(suite: Suite, base_url: str) -> None:
    job = submit(base_url, size="128x128", n=2, x_async=True)
    gateway = suite.service("gateway")
    assert gateway is not None
    os.killpg(gateway.process.pid, signal.SIGTERM)
    assert gateway.process.wait(timeout=60) == 0
    suite.restart("gateway", timeout_s=60)
    done = poll(base_url, job["id"], until={"succeeded", "failed"}, timeout_s=90)
    assert done["status"] == "succeeded", done
    assert [png(item["b64_json"]).size for item in done["result"]["data"]] == [(128, 128)] * 2


@pytest.mark.slow
def test_a_job_whose_gateway_was_killed_mid_run_is_run_again_by_the_next(suite: Suite, base_url: str) -> None:
    job = submit(base_url, size="256x256", n=4, x_async=True)
    running = poll(base_url, job["id"], until={"running", "succeeded", "failed"})
    assert running["status"] == "running", running  # 4 images of 256x256 take seconds on CPU
    gateway = suite.service("gateway")
    assert gateway is not None
    os.killpg(gateway.process.pid, signal.SIGKILL)
    gateway.process.wait(timeout=10)
    suite.restart("gateway", timeout_s=60)
    settings = suite.settings.gateway.images
    done = poll(base_url, job["id"], until={"succeeded", "failed"}, timeout_s=settings.owner_ttl_s + 120)
    assert done["status"] == "succeeded" and done["attempts"] == 2, done
    assert [png(item["b64_json"]).size for item in done["result"]["data"]] == [(256, 256)] * 4
