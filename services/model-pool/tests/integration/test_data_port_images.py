"""JPEG and PNG tensors through the worker's data port: decoded off the loop, in order, within
the decode-time limit."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from loadmaster.common.gateway_config import GatewaySettings, LimitsSettings
from loadmaster.v1 import errors_pb2, tensor_pb2

from .conftest import DataClient, FakeScheduler, running_worker, worker_settings

OK = errors_pb2.ERROR_CODE_UNSPECIFIED
INVALID = errors_pb2.ERROR_CODE_INVALID_ARGUMENT


def frame(height: int, width: int) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 255 / width, y * 255 / height, (x + y) * 255 / (width + height)], -1).astype(
        np.uint8
    )


def with_image(client: DataClient, data: bytes, shape: tuple[int, ...], encoding: int, **fields: Any) -> Any:
    request, payload = client.request("echo", {"state": np.ones(2, np.float32)}, **fields)
    request.inputs.add(
        key="camera",
        dtype=tensor_pb2.DTYPE_UINT8,
        shape=shape,
        byte_offset=len(payload),
        byte_length=len(data),
        encoding=encoding,  # type: ignore[arg-type]
    )
    return request, payload + data


async def start(
    example_repo: Path, leases: Any, scheduler: tuple[FakeScheduler, str], decode_ms: float
) -> Any:
    settings = worker_settings(example_repo, scheduler[1], preload=["echo"])
    settings = settings.model_copy(
        update={"gateway": GatewaySettings(limits=LimitsSettings(max_image_decode_ms=decode_ms))}
    )
    return running_worker(settings, lease_client=leases)


@pytest.fixture
async def image_client(
    example_repo: Path, leases: Any, scheduler: tuple[FakeScheduler, str]
) -> AsyncIterator[DataClient]:
    async with await start(example_repo, leases, scheduler, 250.0) as server:
        client = DataClient(server.data_endpoint)
        yield client
        client.close()


async def test_jpeg_tensor_decodes_beside_raw_ones(image_client: DataClient) -> None:
    pixels = frame(240, 320)
    data = simplejpeg.encode_jpeg(pixels, quality=90)
    await image_client.send(*with_image(image_client, data, (240, 320, 3), tensor_pb2.ENCODING_JPEG))
    reply, outputs = await image_client.receive()
    assert reply.error_code == OK, reply.error_message
    assert outputs["camera"].shape == (240, 320, 3) and outputs["camera"].dtype == np.uint8
    assert np.abs(outputs["camera"].astype(int) - pixels).mean() < 2.0
    assert outputs["state"].tolist() == [1.0, 1.0]


async def test_a_corrupt_image_is_answered_and_requests_keep_their_order(image_client: DataClient) -> None:
    data = simplejpeg.encode_jpeg(frame(240, 320), quality=90)
    await image_client.send(
        *with_image(image_client, data[:2000], (240, 320, 3), tensor_pb2.ENCODING_JPEG, request_id="bad")
    )
    request, payload = image_client.request("echo", {"x": np.ones(3, np.float32)}, request_id="next")
    await image_client.send(request, payload)  # raw, right behind the image request
    first, _ = await image_client.receive()
    second, outputs = await image_client.receive()
    assert (first.request_id, second.request_id) == ("bad", "next")
    assert first.error_code == INVALID and "tensor 'camera': corrupt JPEG" in first.error_message
    assert second.error_code == OK and outputs["x"].tolist() == [1.0] * 3


async def test_decoding_past_the_time_limit_is_answered(
    example_repo: Path, leases: Any, scheduler: tuple[FakeScheduler, str]
) -> None:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (1500, 2000, 3), dtype=np.uint8)).save(
        buffer, "PNG", compress_level=1
    )
    async with await start(example_repo, leases, scheduler, 1.0) as server:  # 1 ms: no 3 MP PNG fits
        client = DataClient(server.data_endpoint)
        try:
            await client.send(
                *with_image(client, buffer.getvalue(), (1500, 2000, 3), tensor_pb2.ENCODING_PNG)
            )
            reply, _ = await client.receive()
            assert reply.error_code == INVALID
            assert "tensor 'camera': decoding took longer than the limit of 1 ms" in reply.error_message
            reply, outputs = await client.call("echo", {"x": np.ones(2, np.float32)})  # still serving
            assert reply.error_code == OK and outputs["x"].tolist() == [1.0, 1.0]
        finally:
            client.close()
