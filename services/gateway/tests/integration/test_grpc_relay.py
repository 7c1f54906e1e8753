"""The gRPC relay (`frontends/grpc_relay.py`) in this process, in front of an upstream gRPC
server on a unix socket: what a call carries must come out the other side unchanged (bytes,
metadata, deadline, status, details, trailers, cancellation, streams), and large messages of the
hand-off methods travel through shared memory both ways, leaving no file behind."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from loadmaster.common.ports import free_port
from loadmaster.gateway.frontends import grpc_handoff
from loadmaster.gateway.frontends.grpc_relay import RelayConfig, serve

LARGE = 1 << 20
METHODS = {
    "/t.S/Echo": "unary_unary",
    "/t.S/Fail": "unary_unary",
    "/t.S/Hang": "unary_unary",
    "/t.S/Big": "unary_unary",
    "/t.S/Chat": "stream_stream",
    "/t.S/Count": "unary_stream",
}


class Upstream:
    """What the gateway's server would be: raw bytes in and out, taking and handing off markers."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.seen: list[bytes] = []
        self.cancelled = asyncio.Event()

    def incoming(self, message: bytes) -> bytes:
        self.seen.append(message[:1])
        if grpc_handoff.is_marker(message):
            return bytes(grpc_handoff.take(message, directory=self.directory))
        return message

    def outgoing(self, message: bytes) -> bytes:
        if len(message) > LARGE:
            marker = grpc_handoff.hand_off([message], directory=self.directory)
            assert marker is not None
            return marker
        return message

    def handler(self) -> grpc.GenericRpcHandler:
        async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            metadata = {
                key: value if isinstance(value, str) else value.hex()
                for key, value in context.invocation_metadata()
            }
            return json.dumps(
                {"request": request.decode(), "metadata": metadata, "left_s": context.time_remaining()}
            ).encode()

        async def fail(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such thing", (("loadmaster-error-code", "2"),))
            return b""

        async def hang(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            return b""

        async def big(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return self.outgoing(self.incoming(request)[::-1])

        async def chat(
            requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[bytes]:
            async for message in requests:
                yield self.outgoing(self.incoming(message))

        async def count(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            for n in range(int(request)):
                yield str(n).encode()

        return grpc.method_handlers_generic_handler(
            "t.S",
            {
                "Echo": grpc.unary_unary_rpc_method_handler(echo),
                "Fail": grpc.unary_unary_rpc_method_handler(fail),
                "Hang": grpc.unary_unary_rpc_method_handler(hang),
                "Big": grpc.unary_unary_rpc_method_handler(big),
                "Chat": grpc.stream_stream_rpc_method_handler(chat),
                "Count": grpc.unary_stream_rpc_method_handler(count),
            },
        )


@pytest.fixture()
async def relayed(tmp_path: Path) -> AsyncIterator[tuple[grpc.aio.Channel, Upstream]]:
    shm = tmp_path / "shm"
    shm.mkdir()
    upstream = Upstream(shm)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((upstream.handler(),))
    socket = f"unix:{tmp_path / 'up.sock'}"
    server.add_insecure_port(socket)
    await server.start()
    listen = f"127.0.0.1:{free_port()}"
    config = RelayConfig(
        listen=listen,
        upstream=socket,
        methods=METHODS,
        handoff_methods=["/t.S/Big", "/t.S/Chat"],
        large_message_bytes=LARGE,
        grace_s=1.0,
        shm_directory=str(shm),
    )
    stop = asyncio.Event()
    relay = asyncio.create_task(serve(config, stopped=stop.wait))
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    channel = grpc.aio.insecure_channel(listen, options=options)
    try:
        await asyncio.wait_for(channel.channel_ready(), 10)
        yield channel, upstream
    finally:
        await channel.close()
        stop.set()
        await relay
        await server.stop(0)


async def test_bytes_metadata_and_deadline_pass_through(relayed: Any) -> None:
    channel, _ = relayed
    reply = await channel.unary_unary("/t.S/Echo")(
        b"hello", metadata=(("authorization", "Bearer k"), ("x-blob-bin", b"\x00\x01")), timeout=5
    )
    seen = json.loads(reply)
    assert seen["request"] == "hello"
    assert seen["metadata"]["authorization"] == "Bearer k"
    assert seen["metadata"]["x-blob-bin"] == "0001"
    assert 0 < seen["left_s"] <= 5.5  # (the wire rounds a deadline up)


async def test_a_failure_keeps_its_status_details_and_trailers(relayed: Any) -> None:
    channel, _ = relayed
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await channel.unary_unary("/t.S/Fail")(b"", timeout=5)
    assert failed.value.code() == grpc.StatusCode.NOT_FOUND
    assert failed.value.details() == "no such thing"
    assert ("loadmaster-error-code", "2") in tuple(failed.value.trailing_metadata() or ())


async def test_a_cancelled_call_is_cancelled_upstream(relayed: Any) -> None:
    channel, upstream = relayed
    call = channel.unary_unary("/t.S/Hang")(b"", timeout=30)
    await asyncio.sleep(0.3)
    call.cancel()
    await asyncio.wait_for(upstream.cancelled.wait(), 10)


async def test_a_deadline_that_passes_ends_the_call_upstream(relayed: Any) -> None:
    channel, upstream = relayed
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await channel.unary_unary("/t.S/Hang")(b"", timeout=0.5)
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(upstream.cancelled.wait(), 10)


async def test_a_method_the_relay_does_not_know_is_unimplemented(relayed: Any) -> None:
    channel, _ = relayed
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await channel.unary_unary("/t.S/Other")(b"", timeout=5)
    assert failed.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_large_messages_go_through_shared_memory_both_ways(relayed: Any) -> None:
    channel, upstream = relayed
    message = bytes(range(256)) * (3 << 12)  # 3 MiB
    reply = await channel.unary_unary("/t.S/Big")(message, timeout=30)
    assert reply == message[::-1]
    assert upstream.seen == [grpc_handoff.MARKER]  # the upstream got a marker, not the bytes
    assert list(upstream.directory.iterdir()) == []


async def test_a_client_message_starting_with_a_zero_byte_names_no_file(relayed: Any) -> None:
    channel, upstream = relayed
    planted = upstream.directory / ("loadmaster-grpc-1-" + "ab" * 16)
    planted.write_bytes(b"x" * 10)
    reply = await channel.unary_unary("/t.S/Big")(b"\x00" + planted.name.encode(), timeout=5)
    assert reply == b"\x00"  # it arrived as a lone zero byte
    assert planted.read_bytes() == b"x" * 10


async def test_streams_relay_each_message_in_order(relayed: Any) -> None:
    channel, upstream = relayed
    messages = [b"one", b"y" * (2 << 20), b"three", b"z" * (LARGE + 1)]

    async def requests() -> AsyncIterator[bytes]:
        for message in messages:
            yield message

    replies = [reply async for reply in channel.stream_stream("/t.S/Chat")(requests(), timeout=30)]
    assert replies == messages
    assert upstream.seen == [b"o", grpc_handoff.MARKER, b"t", grpc_handoff.MARKER]
    assert list(upstream.directory.iterdir()) == []
    counted = [reply async for reply in channel.unary_stream("/t.S/Count")(b"3", timeout=5)]
    assert counted == [b"0", b"1", b"2"]
