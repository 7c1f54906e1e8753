"""Payloads in shared memory on the worker's data port: a gateway's region (a real one under
/dev/shm), a real DEALER, and every way a reference can be wrong."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from loadmaster.common.shm import REGION_PREFIX, ShmArena
from loadmaster.v1 import errors_pb2, model_pool_pb2

OK = errors_pb2.ERROR_CODE_UNSPECIFIED
INVALID = errors_pb2.ERROR_CODE_INVALID_ARGUMENT
IMAGE = np.random.default_rng(0).integers(0, 255, (480, 640, 3), dtype=np.uint8)


@pytest.fixture
def arena() -> Iterator[ShmArena]:
    region = ShmArena(8 << 20, quarantine_s=1.0)
    yield region
    region.close()
    assert not region.path.exists()


def shm_request(client: Any, arena: ShmArena, arrays: dict[str, np.ndarray]) -> model_pool_pb2.InferRequest:
    request, payload = client.request("double", arrays)
    slot = arena.put(payload)
    assert slot is not None
    request.shm.region, request.shm.offset, request.shm.size = arena.name, slot.offset, slot.size
    return request


async def test_image_in_shared_memory_is_answered(client: Any, arena: ShmArena) -> None:
    arena.put(b"x" * 1000)  # the image's slot does not start at 0
    request = shm_request(client, arena, {"x": IMAGE})
    assert request.shm.offset > 0
    await client.send(request, b"")  # no payload frame content: the bytes are in the region
    reply, outputs = await client.receive()
    assert reply.error_code == OK, reply.error_message
    np.testing.assert_array_equal(outputs["x"], (IMAGE.astype(np.int32) * 2 % 256).astype(np.uint8))


async def test_bad_references_are_answered_and_the_port_keeps_serving(client: Any, arena: ShmArena) -> None:
    request = shm_request(client, arena, {"x": np.ones(4, np.float32)})
    cases: list[tuple[dict[str, Any], bytes, str]] = [
        ({"region": "../../etc/passwd"}, b"", "shm.region"),
        ({"region": "loadmaster-gw-1-x"}, b"", "shm.region"),
        ({"offset": (8 << 20) - 8}, b"", "shm.offset/shm.size"),
        ({"size": (8 << 20) + 1}, b"", "shm.offset/shm.size"),
        ({}, b"\0" * 16, "payload frame must be empty"),
    ]
    for fields, frame, names in cases:
        bad = model_pool_pb2.InferRequest()
        bad.CopyFrom(request)
        for field, value in fields.items():
            setattr(bad.shm, field, value)
        await client.send(bad, frame)
        reply, outputs = await client.receive()
        assert reply.error_code == INVALID, (fields, reply)
        assert names in reply.error_message and not reply.retryable and not reply.shm_unusable
        assert outputs == {}
    # A slot too short for the tensors is the tensor codec's error, naming the tensor.
    short = model_pool_pb2.InferRequest()
    short.CopyFrom(request)
    short.shm.size = 8
    await client.send(short, b"")
    reply, _ = await client.receive()
    assert reply.error_code == INVALID and "tensor 'x'" in reply.error_message

    await client.send(request, b"")
    reply, outputs = await client.receive()
    assert reply.error_code == OK and outputs["x"].tolist() == [2.0] * 4


async def test_region_the_worker_cannot_open_is_retryable_and_says_so(client: Any) -> None:
    request, _ = client.request("double", {"x": np.ones(4, np.float32)})
    request.shm.region = f"{REGION_PREFIX}{os.getpid()}-{'0' * 32}"  # well-formed, not there
    request.shm.size = 16
    await client.send(request, b"")
    reply, _ = await client.receive()
    assert reply.error_code == errors_pb2.ERROR_CODE_UNAVAILABLE
    assert reply.retryable and reply.shm_unusable
    assert "cannot be opened" in reply.error_message
