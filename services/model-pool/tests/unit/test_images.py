"""JPEG and PNG tensors decoded by the worker's `ImageDecoder` (no sockets)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.common.tensors import TensorLimits, encode_tensors
from loadmaster.model_pool.images import (
    ImageDecoder,
    ImageLimits,
    decode_request,
    gpu_jpeg_decoder,
    image_format,
)
from loadmaster.v1 import tensor_pb2


def frame(height: int = 48, width: int = 64, channels: int = 3) -> np.ndarray:
    """A smooth camera-like picture: gradients (JPEG keeps them within a few levels)."""
    y, x = np.mgrid[0:height, 0:width]
    planes = [x * 255 / width, y * 255 / height, (x + y) * 255 / (width + height), np.full_like(x, 200)]
    return np.stack(planes[:channels], -1).astype(np.uint8)


def jpeg(pixels: np.ndarray, *, progressive: bool = False) -> bytes:
    if progressive:  # (simplejpeg writes baseline JPEGs only)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, "JPEG", quality=95, progressive=True)
        return buffer.getvalue()
    return simplejpeg.encode_jpeg(pixels, quality=95, colorspace="GRAY" if pixels.shape[2] == 1 else "RGB")


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels[..., 0] if pixels.shape[2] == 1 else pixels).save(buffer, "PNG")
    return buffer.getvalue()


def descriptor(
    data: bytes, shape: tuple[int, ...], encoding: int = tensor_pb2.ENCODING_JPEG
) -> tensor_pb2.Tensor:
    return tensor_pb2.Tensor(
        key="camera", dtype=tensor_pb2.DTYPE_UINT8, shape=shape, byte_length=len(data), encoding=encoding
    )


DECODER = ImageDecoder()


@pytest.mark.parametrize("channels", [1, 3])
def test_jpeg_decodes_to_its_pixels(channels: int) -> None:
    pixels = frame(channels=channels)
    data = jpeg(pixels)
    decoded = DECODER.decode_tensor(descriptor(data, pixels.shape), memoryview(data))
    assert decoded.shape == pixels.shape and decoded.dtype == np.uint8
    assert np.abs(decoded.astype(int) - pixels).mean() < 2.0  # lossy, but close


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_png_decodes_exactly(channels: int) -> None:
    pixels = frame(channels=channels)
    data = png(pixels)
    decoded = DECODER.decode_tensor(descriptor(data, pixels.shape, tensor_pb2.ENCODING_PNG), memoryview(data))
    np.testing.assert_array_equal(decoded, pixels)


def test_a_shape_that_is_not_the_images_is_refused() -> None:
    data = jpeg(frame())
    for claimed in [(48, 64, 1), (64, 48, 3), (48, 65, 3)]:
        with pytest.raises(InvalidArgumentError, match=r"tensor 'camera': the JPEG image is \[48, 64, 3\]"):
            DECODER.decode_tensor(descriptor(data, claimed), memoryview(data))


def test_corrupt_images_are_refused_naming_the_tensor() -> None:
    good = jpeg(frame())
    for bad in [b"\xff\xd8\xff" + bytes(40), good[: len(good) // 2], b"not an image at all"]:
        with pytest.raises(InvalidArgumentError, match="tensor 'camera'"):
            DECODER.decode_tensor(descriptor(bad, (48, 64, 3)), memoryview(bad))
    damaged = bytearray(png(frame()))
    damaged[60:70] = bytes(10)  # inside the image data: the CRC no longer matches
    with pytest.raises(InvalidArgumentError, match=r"tensor 'camera'.*PNG"):
        DECODER.decode_tensor(
            descriptor(bytes(damaged), (48, 64, 3), tensor_pb2.ENCODING_PNG), memoryview(damaged)
        )


def test_a_png_sent_as_jpeg_is_refused() -> None:
    data = png(frame())
    with pytest.raises(InvalidArgumentError, match="tensor 'camera': not a readable JPEG"):
        DECODER.decode_tensor(descriptor(data, (48, 64, 3)), memoryview(data))


def test_pixel_and_scan_limits_hold_before_decoding() -> None:
    data = jpeg(frame(64, 64))
    small = ImageDecoder(ImageLimits(max_pixels=64 * 63))
    with pytest.raises(InvalidArgumentError, match="exceeds the limit of 4032 pixels"):
        small.decode_tensor(descriptor(data, (64, 64, 3)), memoryview(data))
    progressive = jpeg(frame(64, 64), progressive=True)
    scans = progressive.count(b"\xff\xda")
    assert scans > 2
    few = ImageDecoder(ImageLimits(max_scans=scans - 1))
    with pytest.raises(InvalidArgumentError, match=f"{scans} scans exceeds the limit"):
        few.decode_tensor(descriptor(progressive, (64, 64, 3)), memoryview(progressive))
    assert ImageDecoder(ImageLimits(max_scans=scans)).decode_tensor(
        descriptor(progressive, (64, 64, 3)), memoryview(progressive)
    ).shape == (64, 64, 3)


def test_declared_image_inputs_take_bytes_elements() -> None:
    pixels = frame()
    one = np.array([jpeg(pixels)], dtype=object)
    assert DECODER.decode_declared("image", one, (48, 64, 3)).shape == (48, 64, 3)
    assert DECODER.decode_declared("image", one, (-1, -1, 3)).shape == (48, 64, 3)
    batch = np.array([jpeg(pixels), png(pixels)], dtype=object)
    assert DECODER.decode_declared("image", batch, (-1, 48, 64, 3)).shape == (2, 48, 64, 3)
    with pytest.raises(InvalidArgumentError, match="tensor 'image': one compressed image expected"):
        DECODER.decode_declared("image", batch, (48, 64, 3))
    with pytest.raises(InvalidArgumentError, match="tensor 'image': the JPEG image is"):
        DECODER.decode_declared("image", one, (480, 640, 3))
    with pytest.raises(InvalidArgumentError, match="tensor 'image': not a JPEG or PNG"):
        DECODER.decode_declared("image", np.array([b"GIF89a"], dtype=object), (48, 64, 3))


def test_decode_request_decodes_images_beside_raw_tensors() -> None:
    pixels = frame()
    data = jpeg(pixels)
    descriptors, raw = encode_tensors({"state": np.ones(4, np.float32)})
    image = descriptor(data, pixels.shape)
    image.byte_offset = len(raw)
    seen: list[str] = []
    arrays = decode_request(
        [*descriptors, image], bytes(raw) + data, TensorLimits(), DECODER, on_tensor=seen.append
    )
    assert arrays["state"].tolist() == [1.0] * 4 and arrays["camera"].shape == (48, 64, 3)
    assert seen == ["camera"]
    descriptors, payload = encode_tensors({"image": np.array([data], dtype=object)})
    arrays = decode_request(descriptors, payload, TensorLimits(), DECODER, declared={"image": (48, 64, 3)})
    assert arrays["image"].shape == (48, 64, 3) and arrays["image"].dtype == np.uint8


def test_image_format_sniffs_the_magic_bytes() -> None:
    assert image_format(jpeg(frame())) == "jpeg"
    assert image_format(png(frame())) == "png"
    assert image_format(b"BM....") == ""


def test_no_gpu_decoder_on_cpu() -> None:
    assert gpu_jpeg_decoder("cpu") is None


def test_gpu_jpeg_decoder_matches_the_cpu() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchvision", reason="torchvision (extra gpu-images) is not installed: CPU-only run")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the nvJPEG path only runs on a GPU worker")
    gpu = gpu_jpeg_decoder("cuda:0")
    assert gpu is not None
    pixels = frame(480, 640)
    data = jpeg(pixels)
    decoded = ImageDecoder(gpu_jpeg=gpu).decode_tensor(descriptor(data, pixels.shape), memoryview(data))
    cpu = DECODER.decode_tensor(descriptor(data, pixels.shape), memoryview(data))
    assert decoded.shape == cpu.shape and np.abs(decoded.astype(int) - cpu).max() <= 8
