"""Local links (loadmaster.common.local_link): framing over a real Unix socket, a peer that
reads late, a peer that leaves, and the process-state check that stands in for heartbeats."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from loadmaster.common import local_link

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="abstract Unix sockets are Linux's")


class _Pair:
    """Two FrameSockets on the ends of one socketpair, collecting what each receives."""

    def __init__(self) -> None:
        left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        left.setblocking(False)
        right.setblocking(False)
        self.received: asyncio.Queue[list[bytes]] = asyncio.Queue()
        self.closed: list[str] = []
        self.sender = local_link.FrameSocket(left, lambda frames: None, self.closed.append, name="left")
        self.receiver = local_link.FrameSocket(
            right, lambda frames: self.received.put_nowait([bytes(f) for f in frames]), print, name="right"
        )

    async def next(self) -> list[bytes]:
        return await asyncio.wait_for(self.received.get(), 10)


async def test_messages_arrive_whole_and_in_order_whatever_their_size() -> None:
    pair = _Pair()
    big = os.urandom(9 << 20)  # far more than one receive: arrives in many pieces
    messages: list[list[Any]] = [
        [b"", b"envelope", b"payload"],
        [b"kind", b""],
        [b"", b"e", big],
        [memoryview(b"view"), bytearray(b"array")],
        [b"x" * n for n in range(40)],
    ]
    for frames in messages:
        pair.sender.send(frames)
    for frames in messages:
        assert await pair.next() == [bytes(f) for f in frames]


async def test_queued_messages_leave_on_flush_in_order() -> None:
    pair = _Pair()
    for index in range(600):  # 2,400 buffers: more than one sendmsg may take
        pair.sender.queue([b"", str(index).encode(), b"p" * (index % 50)])
    assert pair.received.empty()
    pair.sender.flush()
    got = [await pair.next() for _ in range(600)]
    assert [int(frames[1]) for frames in got] == list(range(600))
    assert all(frames[2] == b"p" * (int(frames[1]) % 50) for frames in got)


class _CountingSocket:
    """The sender's real socket, with its sendmsg calls counted."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sendmsg_calls = 0

    def sendmsg(self, buffers: Any) -> int:
        self.sendmsg_calls += 1
        return self.sock.sendmsg(buffers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


async def test_messages_sent_soon_in_one_turn_leave_in_one_write_at_its_end() -> None:
    pair = _Pair()
    counted = pair.sender._sock = _CountingSocket(pair.sender._sock)  # type: ignore[assignment]
    for index in range(5):
        pair.sender.send_soon([b"", str(index).encode(), b"payload"])
    assert counted.sendmsg_calls == 0  # nothing leaves before the turn ends
    got = [await pair.next() for _ in range(5)]
    assert [frames[1] for frames in got] == [str(index).encode() for index in range(5)]
    assert counted.sendmsg_calls == 1
    pair.sender.send_soon([b"", b"next turn", b""])  # a later turn: a write of its own
    assert (await pair.next())[1] == b"next turn"
    assert counted.sendmsg_calls == 2


async def test_a_message_sent_soon_to_a_peer_gone_ends_the_link_and_says_so() -> None:
    pair = _Pair()
    pair.receiver.close()
    pair.sender.send_soon([b"", b"to nobody", b""])
    for _ in range(100):
        if pair.closed:
            break
        await asyncio.sleep(0.01)
    assert len(pair.closed) == 1 and pair.sender.closed


async def test_what_a_slow_reader_does_not_take_waits_and_arrives_intact() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left.setblocking(False)
    sender = local_link.FrameSocket(left, lambda frames: None, print, name="left")
    chunks = [os.urandom(1 << 20) for _ in range(12)]  # 12 MiB: well past the socket's buffer
    for index, chunk in enumerate(chunks):
        sender.send([str(index).encode(), chunk])
    await asyncio.sleep(0.05)
    right.setblocking(False)  # only now does anyone read
    received: asyncio.Queue[list[bytes]] = asyncio.Queue()
    local_link.FrameSocket(right, lambda f: received.put_nowait([bytes(x) for x in f]), print, name="right")
    for index, chunk in enumerate(chunks):
        frames = await asyncio.wait_for(received.get(), 10)
        assert frames == [str(index).encode(), chunk]


async def test_a_peer_that_leaves_ends_the_link_once_and_sends_after_it_do_nothing() -> None:
    pair = _Pair()
    pair.receiver.close()
    for _ in range(100):
        if pair.closed:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert len(pair.closed) == 1 and "closed" in pair.closed[0]
    assert pair.sender.closed
    pair.sender.send([b"", b"late"])  # no error, nothing sent
    assert len(pair.closed) == 1


async def test_a_listener_is_found_by_its_endpoints_port_and_nothing_else_is() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    name = local_link.local_name(f"tcp://0.0.0.0:{port}")
    assert name == local_link.reachable_locally(f"tcp://127.0.0.1:{port}")
    listener = local_link.listen(name)
    try:
        with pytest.raises(OSError):
            local_link.listen(name)  # one worker per port
        sock = local_link.connect(name)
        assert sock is not None
        assert local_link.peer_pid(sock) == os.getpid()
        sock.close()
    finally:
        listener.close()
    assert local_link.connect(name) is None  # nobody listens any more: the caller uses ZMQ


def test_only_numeric_loopback_tcp_endpoints_are_reached_locally() -> None:
    assert local_link.reachable_locally("tcp://127.0.0.1:5556") == "\0loadmaster-data-5556"
    assert local_link.reachable_locally("tcp://[::1]:5556") == "\0loadmaster-data-5556"
    for endpoint in ("tcp://10.1.2.3:5556", "tcp://worker-1:5556", "ipc:///tmp/x", "tcp://127.0.0.1:*"):
        assert local_link.reachable_locally(endpoint) is None, endpoint


def test_a_stopped_process_is_seen_stopped_and_a_gone_one_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert local_link.process_stopped(child.pid) is False
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not local_link.process_stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert local_link.process_stopped(child.pid) is True
        os.kill(child.pid, signal.SIGCONT)
        deadline = time.monotonic() + 5
        while local_link.process_stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert local_link.process_stopped(child.pid) is False
    finally:
        child.kill()
        child.wait(10)
    assert local_link.process_stopped(child.pid) is None
