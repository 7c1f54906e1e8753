"""The official `openai` client against the real suite, with `tiny-chat-process`: tiny-chat
served by an engine process (`transformers serve`) that the model-pool worker starts under a
GPU lease on the first request. Chat and streamed text completions come back through the
gateway; the lease names the model; and when the worker is killed with SIGKILL, its engine
process dies with it (parent-death signal). The worker is started again afterwards."""

from __future__ import annotations

import time
from collections.abc import Callable

import openai
import psutil
import pytest

from loadmaster.cli.launcher import Suite
from loadmaster.v1 import gpu_broker_pb2

pytestmark = pytest.mark.slow  # the engine's cold start, and a worker restart (~40 s)

MODEL = "tiny-chat-process"


def _engines(worker_pid: int) -> list[psutil.Process]:
    return [
        child
        for child in psutil.Process(worker_pid).children(recursive=True)
        if "serve" in " ".join(child.cmdline())
    ]


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_an_openai_client_is_answered_by_an_engine_process_that_dies_with_its_worker(
    suite: Suite, list_leases: Callable[[], list[gpu_broker_pb2.Lease]]
) -> None:
    gateway = suite.settings.gateway
    client = openai.OpenAI(
        base_url=f"http://{gateway.http_host}:{gateway.http_port}/v1",
        api_key="none",
        max_retries=0,
        timeout=180,
    )
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
    )
    reply = raw.parse()
    assert reply.model == MODEL and raw.headers["x-loadmaster-model"] == MODEL
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 8 and reply.usage.prompt_tokens > 0

    stream = client.completions.create(
        model=MODEL, prompt="once upon", max_tokens=6, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]

    assert [lease.labels["model"] for lease in list_leases()].count(MODEL) == 1
    worker = suite.service("model-pool")
    assert worker is not None
    engines = _engines(worker.process.pid)
    assert len(engines) == 1, engines
    engine = engines[0]
    assert engine.pid == psutil.Process(engine.pid).pid and _running(engine)

    worker.process.kill()  # SIGKILL: no cleanup of its own runs
    worker.process.wait(10)
    deadline = time.monotonic() + 15
    while _running(engine):
        assert time.monotonic() < deadline, "the engine process outlived its worker"
        time.sleep(0.05)
    suite.restart("model-pool", timeout_s=120)
    suite.wait_for_models(suite.settings.model_pool.preload, timeout_s=120)
