"""The image API on a real gateway process with no scheduler behind it (so every well-formed
request is answered `unavailable`): validation over HTTP with the `openai` client, and async
jobs in a real Redis: a finished (here: failed) job is readable, then gone after `job_ttl_s`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from loadmaster.common.ports import free_port

from .conftest import GatewayProcess

JOB_TTL_S = 1.0


@pytest.fixture(scope="module")
def gateway(start_gateway: Callable[..., GatewayProcess], redis_url: str) -> GatewayProcess:
    images = {"job_ttl_s": JOB_TTL_S, "job_key_prefix": "test:images-http", "sizes": ["64x64", "256x256"]}
    return start_gateway({"images": images}, redis_url=redis_url)


@pytest.fixture(scope="module")
def no_redis_gateway(start_gateway: Callable[..., GatewayProcess]) -> GatewayProcess:
    return start_gateway()


def client(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.http_url + "/v1", api_key="none", max_retries=0, timeout=30)


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"size": "512x512"}, "size"), ({"n": 5}, "n"), ({"response_format": "url"}, "response_format")],
)
def test_validation_answers_400_naming_the_field(
    gateway: GatewayProcess, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(gateway).images.generate(model="m", prompt="x", **fields)
    body: Any = caught.value.body
    assert body["param"] == param and body["type"] == "invalid_request_error"


def test_a_well_formed_request_with_no_scheduler_is_unavailable(gateway: GatewayProcess) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client(gateway).images.generate(model="m", prompt="x", size="64x64")
    assert caught.value.status_code == 503


def poll(url: str, until: Callable[[httpx.Response], bool], timeout_s: float = 10.0) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        reply = httpx.get(url, timeout=5)
        if until(reply) or time.monotonic() > deadline:
            return reply
        time.sleep(0.05)


def test_a_finished_job_is_kept_for_the_ttl_then_gone(gateway: GatewayProcess) -> None:
    submitted = httpx.post(
        gateway.http_url + "/v1/images/generations",
        json={"model": "m", "prompt": "x", "size": "64x64", "x_async": True},
        timeout=10,
    )
    assert submitted.status_code == 202, submitted.text
    url = f"{gateway.http_url}/v1/jobs/{submitted.json()['id']}"
    finished = poll(url, lambda r: r.status_code == 200 and r.json()["status"] == "failed")
    job = finished.json()
    assert (
        job["status"] == "failed" and job["error"]["status"] == 503 and job["error"]["code"] == "unavailable"
    )
    assert job["finished_at"] >= job["created"] and job["expires_at"] <= time.time() + JOB_TTL_S + 1
    gone = poll(url, lambda r: r.status_code == 404, timeout_s=JOB_TTL_S + 5)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "job_id"


def test_without_redis_async_jobs_are_refused_and_sync_requests_still_go(
    no_redis_gateway: GatewayProcess,
) -> None:
    refused = httpx.post(
        no_redis_gateway.http_url + "/v1/images/generations",
        json={"model": "m", "prompt": "x", "size": "256x256", "x_async": True},
        timeout=10,
    )
    assert refused.status_code == 503 and "redis_url" in refused.json()["error"]["message"]
    assert httpx.get(no_redis_gateway.http_url + "/v1/jobs/imgjob-x", timeout=10).status_code == 503
    with pytest.raises(openai.APIStatusError) as caught:
        client(no_redis_gateway).images.generate(model="m", prompt="x", size="256x256")
    assert caught.value.status_code == 503  # it reached the dispatcher: no scheduler here


def test_with_redis_down_the_gateway_starts_and_async_jobs_are_a_clear_503(
    start_gateway: Callable[..., GatewayProcess],
) -> None:
    gateway = start_gateway(redis_url=f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    refused = httpx.post(
        gateway.http_url + "/v1/images/generations",
        json={"model": "m", "prompt": "x", "size": "256x256", "x_async": True},
        timeout=30,
    )
    assert refused.status_code == 503 and "Redis" in refused.json()["error"]["message"]
    assert httpx.get(gateway.http_url + "/v1/jobs/imgjob-x", timeout=30).status_code == 503
