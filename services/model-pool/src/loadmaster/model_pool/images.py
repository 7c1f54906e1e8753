"""Compressed camera frames: JPEG and PNG tensors decoded on the worker to uint8 [H, W, C].

Two ways in, one decoder:
- an image tensor of the edge protocol (encoding JPEG or PNG; its descriptor says UINT8 and the
  decoded shape [H, W, C], its payload slice holds the compressed bytes), decoded through
  `decode_tensors(..., decode_image=decoder.decode_tensor)`;
- a KServe BYTES input that the model declares as an image (`image: true` on a uint8 input in
  its config.yaml): each element is one compressed image, decoded to the declared shape
  (`decode_declared`), [N, H, W, C] when the declared input has a batch axis.

Checks, each before any pixel is decoded: the image's own header against what the request
claims (height, width, channels; 8-bit only), the pixel count against `max_pixels`, and the
number of progressive JPEG scans against `max_scans` (every scan is a pass over the whole
image, so a small file with thousands of scans would take seconds: counting SOS markers is
exact, since 0xFFDA never occurs inside entropy-coded data). What fails is an
`InvalidArgumentError` naming the tensor. The decode-time limit is the data port's
(`max_image_decode_ms`): it answers a request whose images take longer and drops the result.

JPEG is decoded by libjpeg-turbo through simplejpeg, PNG by Pillow; both release the GIL, so
the decoding threads never hold up the event loop. On a CUDA device, JPEG goes to nvJPEG
through `torchvision.io.decode_jpeg(device=...)` when torchvision is installed (the
`gpu-images` extra); the pixels come back to host memory for the engine, so this saves
CPU time, not a copy. That path has only run on CPU-only machines as a skipped test.
"""

from __future__ import annotations

import io
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import simplejpeg
from PIL import Image, UnidentifiedImageError

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.common.tensors import IMAGE_CHANNELS, TensorLimits, decode_tensors
from loadmaster.v1 import tensor_pb2

__all__ = [
    "DEFAULT_IMAGE_LIMITS",
    "ImageDecoder",
    "ImageLimits",
    "decode_request",
    "gpu_jpeg_decoder",
    "image_format",
]

log = logging.getLogger(__name__)

_JPEG_MAGIC = b"\xff\xd8\xff"
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_SOS = b"\xff\xda"
_JPEG_CHANNELS = {"Gray": 1, "YCbCr": 3, "RGB": 3}  # CMYK and YCCK are not RGB pictures
_PNG_CHANNELS = {"L": 1, "RGB": 3, "RGBA": 4}  # 8-bit modes only


@dataclass(frozen=True, slots=True)
class ImageLimits:
    max_pixels: int = 40_000_000
    max_scans: int = 64


DEFAULT_IMAGE_LIMITS = ImageLimits()


def image_format(data: bytes | memoryview) -> str:
    """'jpeg' or 'png' from the leading bytes, '' when neither."""
    head = bytes(data[:8])
    if head.startswith(_JPEG_MAGIC):
        return "jpeg"
    if head.startswith(_PNG_MAGIC):
        return "png"
    return ""


# (compressed bytes, channels) -> uint8 [H, W, C]
JpegDecode = Callable[[bytes | memoryview, int], np.ndarray]


def gpu_jpeg_decoder(device: str) -> JpegDecode | None:
    """nvJPEG through torchvision for a CUDA `device`; None where it cannot run (a CPU device,
    no CUDA, no torchvision)."""
    if not device.startswith("cuda"):
        return None
    try:
        import torch
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError:
        log.info("torchvision is not installed: JPEG tensors decode on the CPU (extra gpu-images)")
        return None
    if not torch.cuda.is_available():
        return None
    lock = threading.Lock()  # one decode at a time per worker: nvJPEG handles are not shared safely

    def decode(data: bytes | memoryview, channels: int) -> np.ndarray:
        encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
        with lock:
            pixels = decode_jpeg(encoded, mode=mode, device=device)  # [C, H, W] on the GPU
            return pixels.permute(1, 2, 0).contiguous().cpu().numpy()

    return decode


class ImageDecoder:
    """Decodes JPEG and PNG tensors within `limits`; thread-safe (no state changes)."""

    def __init__(self, limits: ImageLimits | None = None, *, gpu_jpeg: JpegDecode | None = None) -> None:
        self.limits = limits or DEFAULT_IMAGE_LIMITS
        self._gpu_jpeg = gpu_jpeg

    # ---- the two ways in ---------------------------------------------------------

    def decode_tensor(self, desc: tensor_pb2.Tensor, data: memoryview) -> np.ndarray:
        """An edge image tensor: its descriptor's shape is the decoded one, checked here."""
        expected = tuple(desc.shape)
        if desc.encoding == tensor_pb2.ENCODING_JPEG:
            return self._jpeg(desc.key, data, expected)
        return self._png(desc.key, data, expected)

    def decode_declared(self, name: str, elements: np.ndarray, declared: Sequence[int] | None) -> np.ndarray:
        """A BYTES input the model declares as an image: one element per image, decoded and
        checked against the declared shape ([H, W, C], or [N, H, W, C]; -1 = any size)."""
        flat = elements.reshape(-1)
        batched = declared is not None and len(declared) == 4
        if not batched and flat.size != 1:
            raise InvalidArgumentError(
                f"tensor '{name}': one compressed image expected (a BYTES element), got {flat.size}"
            )
        if flat.size == 0:
            raise InvalidArgumentError(f"tensor '{name}': no compressed image (an empty BYTES tensor)")
        per_image = tuple(declared[-3:]) if declared is not None else (-1, -1, -1)
        images = [self._any(name, element, per_image) for element in flat.tolist()]
        if not batched:
            return images[0]
        if len({image.shape for image in images}) > 1:
            raise InvalidArgumentError(f"tensor '{name}': the images of one request differ in size")
        return np.stack(images)

    # ---- formats -----------------------------------------------------------------

    def _any(self, name: str, data: Any, expected: tuple[int, ...]) -> np.ndarray:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidArgumentError(
                f"tensor '{name}': a compressed image is bytes, not {type(data).__name__}"
            )
        if isinstance(data, bytearray):
            data = bytes(data)
        kind = image_format(data)
        if kind == "jpeg":
            return self._jpeg(name, data, expected)
        if kind == "png":
            return self._png(name, data, expected)
        raise InvalidArgumentError(f"tensor '{name}': not a JPEG or PNG image")

    def _jpeg(self, name: str, data: bytes | memoryview, expected: tuple[int, ...]) -> np.ndarray:
        try:
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        except (ValueError, RuntimeError) as error:
            raise InvalidArgumentError(f"tensor '{name}': not a readable JPEG image ({error})") from None
        channels = _JPEG_CHANNELS.get(colorspace)
        if channels is None:
            raise InvalidArgumentError(
                f"tensor '{name}': {colorspace} JPEG images are not supported (grayscale or colour)"
            )
        self._fits(name, "JPEG", (height, width, channels), expected)
        scans = (data if isinstance(data, bytes) else bytes(data)).count(_SOS)
        if scans > self.limits.max_scans:
            raise InvalidArgumentError(
                f"tensor '{name}': a JPEG image of {scans} scans exceeds the limit of {self.limits.max_scans}"
            )
        if self._gpu_jpeg is not None:
            try:
                return self._gpu_jpeg(data, channels)
            except RuntimeError as error:
                raise InvalidArgumentError(f"tensor '{name}': corrupt JPEG image ({error})") from None
        try:
            # strict: a truncated or damaged stream is an error, not grey blocks
            return simplejpeg.decode_jpeg(data, colorspace="GRAY" if channels == 1 else "RGB", strict=True)
        except (ValueError, RuntimeError) as error:
            raise InvalidArgumentError(f"tensor '{name}': corrupt JPEG image ({error})") from None

    def _png(self, name: str, data: bytes | memoryview, expected: tuple[int, ...]) -> np.ndarray:
        try:
            image = Image.open(io.BytesIO(data), formats=("PNG",))
        except (UnidentifiedImageError, OSError, ValueError) as error:
            raise InvalidArgumentError(f"tensor '{name}': not a readable PNG image ({error})") from None
        with image:
            channels = _PNG_CHANNELS.get(image.mode)
            if channels is None:
                raise InvalidArgumentError(
                    f"tensor '{name}': PNG mode {image.mode} is not supported (8-bit L, RGB or RGBA)"
                )
            width, height = image.size
            self._fits(name, "PNG", (height, width, channels), expected)
            try:
                image.load()
                pixels = np.asarray(image)
            except (OSError, ValueError, SyntaxError) as error:  # truncated, bad CRC, bad zlib stream
                raise InvalidArgumentError(f"tensor '{name}': corrupt PNG image ({error})") from None
        return pixels.reshape(height, width, channels)

    def _fits(self, name: str, kind: str, actual: tuple[int, int, int], expected: tuple[int, ...]) -> None:
        height, width, channels = actual
        if height * width > self.limits.max_pixels:
            raise InvalidArgumentError(
                f"tensor '{name}': a {height} x {width} {kind} image exceeds the limit of "
                f"{self.limits.max_pixels} pixels"
            )
        if channels not in IMAGE_CHANNELS:  # (the tables above hold only these)
            raise InvalidArgumentError(f"tensor '{name}': {channels}-channel images are not supported")
        if len(expected) != 3 or any(e not in (-1, a) for e, a in zip(expected, actual, strict=True)):
            raise InvalidArgumentError(
                f"tensor '{name}': the {kind} image is {list(actual)} (height, width, channels), "
                f"the request says {list(expected)}"
            )


def decode_request(
    descriptors: Sequence[tensor_pb2.Tensor],
    payload: bytes | memoryview,
    limits: TensorLimits,
    decoder: ImageDecoder,
    *,
    declared: Mapping[str, tuple[int, ...] | None] = {},
    on_tensor: Callable[[str], None] | None = None,
) -> dict[str, np.ndarray]:
    """Every input of a request, its images decoded: edge image tensors, and BYTES inputs the
    model `declared` as images (name -> declared shape). `on_tensor(name)` is told which image
    is being decoded (the decode-time limit names it)."""

    def decode_image(desc: tensor_pb2.Tensor, data: memoryview) -> np.ndarray:
        if on_tensor is not None:
            on_tensor(desc.key)
        return decoder.decode_tensor(desc, data)

    arrays = decode_tensors(descriptors, payload, limits, decode_image=decode_image)
    for name, shape in declared.items():
        value = arrays.get(name)
        if value is not None and value.dtype == object:
            if on_tensor is not None:
                on_tensor(name)
            arrays[name] = decoder.decode_declared(name, value, shape)
    return arrays
