"""Images in chat messages: OpenAI's `image_url` parts as parsed, and `ChatImages` turning their
URLs into checked bytes (data URLs; http(s) only from allowed hosts, bounded in size and time).
The fetches go to an httpx mock transport (the one collaborator of this module)."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import pytest
from PIL import Image

from loadmaster.common.config import GatewaySettings
from loadmaster.common.errors import InvalidArgumentError
from loadmaster.gateway.chat_images import ChatImages, host_allowed, image_kind
from loadmaster.gateway.frontends.openai_schema import OpenAIError, parse_chat
from loadmaster.gateway.generation import ChatImage, GenerationRequest


def turns(request: GenerationRequest) -> tuple[tuple[str, str], ...] | None:
    """A request's chat as (role, text) pairs."""
    return None if request.messages is None else tuple((t.role, t.content) for t in request.messages)


def png(size: int = 4) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (size, size), (10, 200, 10)).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def chat(*parts: dict[str, object], model: str = "tiny-vlm") -> GenerationRequest:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": list(parts)}],
    }
    return parse_chat(json.dumps(body).encode())


def image_part(url: str, **extra: object) -> dict[str, object]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def test_image_parts_are_collected_in_order_with_their_message() -> None:
    request = chat(
        image_part("data:image/png;base64,AAAA"),
        {"type": "text", "text": "what"},
        image_part("https://a/b.png"),
    )
    assert turns(request) == (("system", "s"), ("user", "what"))
    assert request.images == (ChatImage(1, "data:image/png;base64,AAAA"), ChatImage(1, "https://a/b.png"))


@pytest.mark.parametrize(
    ("part", "needle"),
    [
        (
            {"type": "input_audio", "input_audio": {}},
            "messages.1.content: part 0: type 'input_audio' is not one of text, image_url",
        ),
        (image_part("https://a/b.png", detail="high"), "messages.1.content.0.image_url.detail"),
        ({"type": "image_url", "image_url": {}}, "messages.1.content.0.image_url.url"),
    ],
)
def test_a_bad_part_is_a_400_naming_it(part: dict[str, object], needle: str) -> None:
    with pytest.raises(OpenAIError) as caught:
        chat(part)
    assert caught.value.status == 400 and needle in caught.value.message
    assert "content.str" not in caught.value.message


def images(**settings: object) -> ChatImages:
    handler = settings.pop("handler", None)
    transport = httpx.MockTransport(handler) if handler is not None else None  # type: ignore[arg-type]
    return ChatImages(GatewaySettings(**settings), transport=transport)  # type: ignore[arg-type]


async def test_data_urls_become_their_bytes() -> None:
    small, large = png(), png(256) + b"\0" * (80 << 10)  # the large one is decoded off the loop
    request = chat(image_part(data_url(small)), image_part(data_url(large)))
    resolved = await images().resolve(request)
    assert [i.data for i in resolved.images] == [small, large]
    assert resolved.messages == request.messages
    plain = chat({"type": "text", "text": "hi"})
    assert await images().resolve(plain) is plain


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("data:text/plain;base64,aGk=", "data:image/<type>;base64"),
        ("data:image/png,rawbytes", "data:image/<type>;base64"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        (data_url(b"GIF8 but not really"), "not a PNG, JPEG, GIF, WebP or BMP"),
        ("ftp://images.example/a.png", "neither a data URL nor an http(s) URL"),
        ("https://elsewhere.example/a.png", "host 'elsewhere.example' is not in gateway.image_url_allow"),
    ],
)
async def test_what_is_not_an_allowed_image_is_refused(url: str, needle: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        await images(image_url_allow=["images.example"]).resolve(chat(image_part(url)))
    assert caught.value.message.startswith("messages[1]: image") and needle in caught.value.message


async def test_too_many_or_too_large_images_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="3 images, at most 2"):
        await images(max_images=2).resolve(chat(*[image_part(data_url(png()))] * 3))
    with pytest.raises(InvalidArgumentError, match="exceeds the limit of 64"):
        await images(image_max_bytes=64).resolve(chat(image_part(data_url(png(64)))))


async def test_allowed_hosts_are_fetched_and_bounded() -> None:
    image = png()
    seen: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        if request.url.path == "/moved.png":
            return httpx.Response(302, headers={"location": "https://evil.example/a.png"})
        if request.url.path == "/missing.png":
            return httpx.Response(404)
        if request.url.path == "/big.png":
            return httpx.Response(200, content=image + b"\0" * 4096)
        if request.url.path == "/slow.png":
            await asyncio.sleep(5)
        return httpx.Response(200, content=image)

    fetcher = images(
        image_url_allow=["images.example", "*.cdn.example"],
        image_max_bytes=2048,
        image_fetch_timeout_s=0.2,
        handler=handler,
    )
    resolved = await fetcher.resolve(
        chat(image_part("https://images.example/a.png"), image_part("http://x.cdn.example/b.png"))
    )
    assert [i.data for i in resolved.images] == [image, image]
    for path, needle in (
        ("moved.png", "answered HTTP 302"),
        ("missing.png", "answered HTTP 404"),
        ("big.png", "exceeds the limit of 2048"),
        ("slow.png", "took longer than 0.2 s"),
    ):
        with pytest.raises(InvalidArgumentError, match=needle):
            await fetcher.resolve(chat(image_part(f"https://images.example/{path}")))
    assert "https://evil.example/a.png" not in seen  # redirects are not followed
    await fetcher.close()


def test_hosts_and_kinds() -> None:
    assert host_allowed("a.cdn.example", ["*.cdn.example"]) and not host_allowed(
        "cdn.example", ["*.cdn.example"]
    )
    assert host_allowed("Images.Example.", ["images.example"]) and not host_allowed(
        "images.example.org", ["images.example"]
    )
    assert (
        image_kind(png()) == "png"
        and image_kind(b"RIFF\0\0\0\0WEBPVP8 ") == "webp"
        and image_kind(b"hello") is None
    )
