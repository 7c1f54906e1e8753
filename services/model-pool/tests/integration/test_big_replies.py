"""A large BYTES reply (the `echo` model sending back many strings) is encoded off the worker's
event loop, and comes back whole."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadmaster.model_pool import data_port
from loadmaster.model_pool.server import ModelPoolServer
from loadmaster.v1 import errors_pb2

from .conftest import DataClient, running_worker, worker_settings

OK = errors_pb2.ERROR_CODE_UNSPECIFIED


@pytest.fixture
async def echo_worker(example_repo: Path, leases: Any, scheduler: Any) -> AsyncIterator[ModelPoolServer]:
    settings = worker_settings(example_repo, scheduler[1], preload=["echo", "double"])
    async with running_worker(settings, lease_client=leases) as server:
        yield server


async def test_a_large_bytes_reply_is_encoded_off_the_loop(
    echo_worker: ModelPoolServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Encoding 20,000 strings holds the GIL element by element: on the loop (as before) it
    held up every other client of the worker; now it runs on the data port's thread."""
    encoded_on: list[str] = []
    real = data_port.result_reply

    def recording(*args: Any, **kwargs: Any) -> Any:
        encoded_on.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(data_port, "result_reply", recording)
    client = DataClient(echo_worker.data_endpoint)
    try:
        text = np.array([f"line {i}".encode() * 8 for i in range(20_000)], dtype=object)
        reply, outputs = await client.call("echo", {"text": text}, request_id="big")
        assert reply.error_code == OK, reply.error_message
        assert outputs["text"].tolist() == text.tolist()
        assert encoded_on and all(name.startswith("data-port-decode") for name in encoded_on), encoded_on
        # A small reply is still encoded on the loop (no thread hop for it).
        reply, outputs = await client.call("echo", {"text": np.array([b"a", b"bc"], dtype=object)})
        assert reply.error_code == OK and outputs["text"].tolist() == [b"a", b"bc"]
        assert len(encoded_on) == 1
    finally:
        client.close()


async def test_a_bytes_reply_that_cannot_be_encoded_is_an_error_reply(
    echo_worker: ModelPoolServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An encoding failure on the thread is answered as one, and the port keeps serving."""

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("cannot encode")

    monkeypatch.setattr(data_port, "result_reply", failing)
    client = DataClient(echo_worker.data_endpoint)
    try:
        text = np.array([b"x" * 16] * 5000, dtype=object)
        reply, _ = await client.call("echo", {"text": text}, request_id="bad")
        assert reply.request_id == "bad"
        assert reply.error_code == errors_pb2.ERROR_CODE_INTERNAL and "cannot encode" in reply.error_message
        reply, outputs = await client.call("double", {"x": np.ones(3, np.float32)})
        assert reply.error_code == OK and outputs["x"].tolist() == [2.0, 2.0, 2.0]
    finally:
        client.close()
