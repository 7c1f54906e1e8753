"""Images in chat messages: each URL a front end parsed becomes checked, encoded bytes.

Every dialect's images arrive here as URLs (OpenAI's `image_url` parts; Ollama's base64
`images` and Anthropic's base64 image blocks are turned into data URLs by their front ends):

- a `data:` URL must be base64 with an `image/*` media type; it is decoded on the validation
  threads when it is large (the event loop only moves it);
- an `http(s):` URL is fetched only when its host is in `gateway.image_url_allow` (an exact
  name, or `*.example.com` for the subdomains of example.com): no redirects (they could leave
  the list), `image_fetch_timeout_s` for the whole fetch, at most `image_max_bytes` read;
- the bytes must start like a PNG, JPEG, GIF, WebP or BMP file and be at most
  `image_max_bytes`; a request carries at most `max_images`.

Anything else is an `InvalidArgumentError` naming the message and the reason, before the
request is queued. The worker decodes the pixels (its engine bounds their count); the
gateway never decodes an image.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import logging
from urllib.parse import urlsplit

import httpx

from loadmaster.common.config import GatewaySettings
from loadmaster.common.errors import InvalidArgumentError
from loadmaster.gateway.generation import ChatImage, GenerationRequest
from loadmaster.gateway.validation import off_loop

__all__ = ["ChatImages", "host_allowed", "image_kind"]

log = logging.getLogger(__name__)

INLINE_DECODE_CHARS = 64 << 10  # base64 text up to this size is decoded on the loop (~20 us)
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"\xff\xd8\xff", "jpeg"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"BM", "bmp"),
)


def image_kind(data: bytes) -> str | None:
    """`png`, `jpeg`, `gif`, `webp` or `bmp` from the first bytes; None for anything else."""
    for signature, kind in _SIGNATURES:
        if data.startswith(signature):
            return kind
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def host_allowed(host: str, allowed: list[str]) -> bool:
    host = host.lower().rstrip(".")
    for entry in allowed:
        entry = entry.lower().rstrip(".")
        if entry == host or (entry.startswith("*.") and host.endswith(entry[1:])):
            return True
    return False


class ChatImages:
    def __init__(
        self, settings: GatewaySettings, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self._allow = list(settings.image_url_allow)
        self._timeout_s = settings.image_fetch_timeout_s
        self._max_bytes = settings.image_max_bytes
        self._max_images = settings.max_images
        self._transport = transport
        self._client: httpx.AsyncClient | None = None

    async def resolve(self, request: GenerationRequest) -> GenerationRequest:
        """`request` with every image's bytes in place (none: `request` itself)."""
        if not request.images:
            return request
        if len(request.images) > self._max_images:
            raise InvalidArgumentError(
                f"messages: {len(request.images)} images, at most {self._max_images} per request"
            )
        images = await asyncio.gather(*(self._one(image) for image in request.images))
        return dataclasses.replace(request, images=tuple(images))

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _one(self, image: ChatImage) -> ChatImage:
        where = f"messages[{image.message}]: image"
        if image.data:
            data = image.data
        elif image.url.startswith("data:"):
            data = await self._data_url(image.url, where)
        else:
            data = await self._fetch(image.url, where)
        if len(data) > self._max_bytes:
            raise InvalidArgumentError(f"{where} of {len(data)} bytes exceeds the limit of {self._max_bytes}")
        if image_kind(data) is None:
            raise InvalidArgumentError(f"{where} is not a PNG, JPEG, GIF, WebP or BMP file")
        return dataclasses.replace(image, data=data)

    async def _data_url(self, url: str, where: str) -> bytes:
        head, comma, text = url.partition(",")
        media = head[len("data:") :].split(";")
        if not comma or media[-1] != "base64" or not media[0].startswith("image/"):
            raise InvalidArgumentError(f"{where}: a data URL must be data:image/<type>;base64,<data>")
        if len(text) * 3 // 4 > self._max_bytes + 3:
            raise InvalidArgumentError(
                f"{where} of about {len(text) * 3 // 4} bytes exceeds the limit of {self._max_bytes}"
            )
        try:
            if len(text) > INLINE_DECODE_CHARS:
                return await off_loop(base64.b64decode, text, validate=True)
            return base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgumentError(f"{where}: the data URL is not valid base64") from None

    async def _fetch(self, url: str, where: str) -> bytes:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidArgumentError(f"{where}: {url[:80]!r} is neither a data URL nor an http(s) URL")
        if not host_allowed(parts.hostname, self._allow):
            raise InvalidArgumentError(
                f"{where}: host '{parts.hostname}' is not in gateway.image_url_allow "
                "(send the image as a data URL, or ask the operator to allow the host)"
            )
        if self._client is None:
            self._client = httpx.AsyncClient(transport=self._transport, follow_redirects=False)
        received = bytearray()
        try:
            async with asyncio.timeout(self._timeout_s):
                async with self._client.stream("GET", url) as response:
                    if response.status_code != 200:
                        raise InvalidArgumentError(
                            f"{where}: fetching {url[:80]} answered HTTP {response.status_code}"
                        )
                    declared = response.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > self._max_bytes:
                        raise InvalidArgumentError(
                            f"{where} of {declared} bytes exceeds the limit of {self._max_bytes}"
                        )
                    async for chunk in response.aiter_bytes():
                        received += chunk
                        if len(received) > self._max_bytes:
                            raise InvalidArgumentError(
                                f"{where} exceeds the limit of {self._max_bytes} bytes"
                            )
        except TimeoutError:
            raise InvalidArgumentError(
                f"{where}: fetching {url[:80]} took longer than {self._timeout_s:g} s"
            ) from None
        except httpx.HTTPError as error:
            raise InvalidArgumentError(f"{where}: fetching {url[:80]} failed: {error}") from None
        return bytes(received)
