"""`SocketReader` and `send_frames` over real loopback ZMQ sockets, read from the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from loadmaster.common.framing import SocketReader, receive_frames, receive_routed, send_frames


@pytest.fixture()
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    """A ROUTER and a DEALER connected to it over tcp loopback."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    yield router, dealer
    router.close(linger=0)
    dealer.close(linger=0)
    context.term()


async def _until(condition: Any, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.001)


async def test_every_message_reaches_the_handler_whole_and_in_order(pair) -> None:
    router, dealer = pair
    received: list[list[bytes]] = []
    send_frames(dealer, [b"", b"early"])  # before the reader watches the socket
    reader = SocketReader(router, lambda frames: received.append([f.bytes for f in frames]), name="test")
    reader.start()
    big = bytes(range(256)) * 4096  # 1 MiB: sent zero-copy
    for index in range(50):
        send_frames(dealer, [b"", str(index).encode(), big if index == 7 else b"p"])
    await _until(lambda: len(received) == 51)
    reader.stop()
    assert received[0][1:] == [b"", b"early"]
    assert [r[2] for r in received[1:]] == [str(i).encode() for i in range(50)]
    assert received[8][3] == big and all(len(r) == 4 for r in received[1:])
    assert len({r[0] for r in received}) == 1  # the dealer's routing identity


async def test_a_relay_sending_from_each_sockets_handler_strands_no_message(pair) -> None:
    """The gateway's shape: what arrives on one socket is sent on the other. A send may take
    the descriptor's signal of a message that arrived on that socket meanwhile; `sent()`
    after each send recovers it, so no message waits for a wake-up that never comes."""
    front, client = pair
    context = zmq.Context()
    back = context.socket(zmq.DEALER)
    echo = context.socket(zmq.ROUTER)
    back.connect(f"tcp://127.0.0.1:{echo.bind_to_random_port('tcp://127.0.0.1')}")
    rounds, in_flight = 2000, 4
    replies: list[bytes] = []

    def on_front(frames: list[zmq.Frame]) -> None:  # client -> relay -> echo
        send_frames(back, [b"", frames[0], frames[2]])
        back_reader.sent()

    def on_back(frames: list[zmq.Frame]) -> None:  # echo -> relay -> client
        send_frames(front, [frames[1], b"", frames[2]])
        front_reader.sent()

    def on_echo(frames: list[zmq.Frame]) -> None:
        send_frames(echo, frames)

    def on_client(frames: list[zmq.Frame]) -> None:
        replies.append(frames[1].bytes)
        if len(replies) + in_flight <= rounds:
            send_frames(client, [b"", str(len(replies) + in_flight - 1).encode()])

    front_reader = SocketReader(front, on_front, name="front")
    back_reader = SocketReader(back, on_back, name="back")
    readers = [front_reader, back_reader, SocketReader(echo, on_echo, name="echo")]
    readers.append(SocketReader(client, on_client, name="client"))
    for reader in readers:
        reader.start()
    try:
        for index in range(in_flight):
            send_frames(client, [b"", str(index).encode()])
        await _until(lambda: len(replies) == rounds, timeout_s=30)
    finally:
        for reader in readers:
            reader.stop()
        back.close(linger=0)
        echo.close(linger=0)
        context.term()
    assert sorted(int(r) for r in replies) == list(range(rounds))


async def test_a_burst_larger_than_burst_is_read_over_several_turns_with_routed_frames(pair) -> None:
    """`receive_routed`: the identity as bytes, the sender's frames as Frames, however many; a
    burst past `burst` messages is finished after other callbacks had their turn."""
    router, dealer = pair
    received: list[list[Any]] = []
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    for index in range(30):
        send_frames(dealer, [b"", str(index).encode(), *([b"x"] if index % 2 else [])])
    assert router.poll(5000)
    await asyncio.sleep(0.05)  # all 30 have arrived
    reader = SocketReader(router, received.append, name="test", burst=8, receive=receive_routed)
    counter = asyncio.create_task(count_turns())
    reader.start()
    await _until(lambda: len(received) == 30)
    reader.stop()
    counter.cancel()
    assert turns >= 3  # 30 messages at 8 per turn
    assert all(isinstance(r[0], bytes) and r[0] == received[0][0] for r in received)
    assert [r[2].bytes for r in received] == [str(i).encode() for i in range(30)]
    assert [len(r) for r in received] == [3 + i % 2 for i in range(30)]


async def test_a_failing_handler_does_not_stop_the_reader(pair) -> None:
    router, dealer = pair
    handled: list[bytes] = []

    def handle(frames: list[zmq.Frame]) -> None:
        handled.append(frames[2].bytes)
        if frames[2].bytes == b"bad":
            raise RuntimeError("boom")

    reader = SocketReader(router, handle, name="test")
    reader.start()
    for body in (b"bad", b"good"):
        send_frames(dealer, [b"", body])
    await _until(lambda: len(handled) == 2)
    reader.stop()
    assert handled == [b"bad", b"good"]


async def test_a_stopped_reader_leaves_messages_on_the_socket(pair) -> None:
    router, dealer = pair
    handled: list[Any] = []
    reader = SocketReader(router, handled.append, name="test")
    reader.start()
    reader.stop()
    send_frames(dealer, [b"", b"later"])
    assert router.poll(5000)
    await asyncio.sleep(0.01)  # the loop runs; the reader no longer watches the socket
    assert handled == []
    assert receive_frames(router)[2].bytes == b"later"


def test_send_frames_refuses_a_message_that_cannot_be_queued() -> None:
    context = zmq.Context()
    lonely = context.socket(zmq.DEALER)  # connected to nobody: nothing can be queued
    try:
        with pytest.raises(zmq.Again):
            send_frames(lonely, [b"", b"x"])
    finally:
        lonely.close(linger=0)
        context.term()
