"""WorkerLinks over a local link (a Unix socket to a worker on this host): an idle worker gets a
call at once; calls sent while others are unanswered leave together at the end of the loop turn,
in one write, in order; a generation message always goes at once."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq.asyncio

from loadmaster.common import local_link
from loadmaster.common.framing import GENERATE_CANCEL_FRAME
from loadmaster.gateway.worker_link import WorkerLinks
from loadmaster.v1 import model_pool_pb2

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="local links are Linux's (abstract Unix sockets)"
)


class _Worker:
    """A worker's local listener in this process: it answers the calls it is told to, in order."""

    def __init__(self, endpoint: str) -> None:
        self.listener = local_link.listen(local_link.local_name(endpoint))
        self.received: list[str] = []
        self.links: list[local_link.FrameSocket] = []
        asyncio.get_running_loop().add_reader(self.listener.fileno(), self._accept)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        conn.setblocking(False)
        self.links.append(local_link.FrameSocket(conn, self._request, print, name="worker"))

    def _request(self, frames: list[memoryview]) -> None:
        if bytes(frames[0]) == GENERATE_CANCEL_FRAME:
            self.received.append("cancel")
        else:
            self.received.append(model_pool_pb2.InferRequest.FromString(frames[1]).request_id)

    def answer(self, request_id: str) -> None:
        reply = model_pool_pb2.InferResponse(request_id=request_id, worker_id="w")
        self.links[0].send([b"", reply.SerializeToString(), b""])

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self.listener.fileno())
        for link in self.links:
            link.close()
        self.listener.close()


class _CountingSocket:
    """The link's real socket, with its sendmsg calls counted."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.writes = 0

    def sendmsg(self, buffers: Any) -> int:
        self.writes += 1
        return int(self.sock.sendmsg(buffers))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


@pytest.fixture()
async def endpoint() -> AsyncIterator[str]:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))  # held: no other listener takes the port's local name
    yield f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    probe.close()


async def _until(check: Any) -> None:
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not reached within 2 s")


async def test_an_idle_worker_gets_a_call_at_once_a_busy_one_the_turns_calls_in_one_write(
    endpoint: str,
) -> None:
    worker = _Worker(endpoint)
    context = zmq.asyncio.Context()
    replies: list[str] = []
    links = WorkerLinks(context, lambda reply, _payload: replies.append(reply.request_id))

    def send(request_id: str) -> None:
        links.send(endpoint, model_pool_pb2.InferRequest(request_id=request_id).SerializeToString(), b"")

    try:
        send("r0")
        local = links._links[endpoint].local
        assert local is not None  # the Unix socket, not ZMQ
        counted = local._sock = _CountingSocket(local._sock)  # type: ignore[assignment]
        await _until(lambda: worker.received == ["r0"])
        worker.answer("r0")
        await _until(lambda: replies == ["r0"])

        send("r1")  # nothing unanswered: written before send returns
        assert counted.writes == 1
        send("r2")  # r1 unanswered: held to the end of the turn, with r3
        send("r3")
        assert counted.writes == 1
        await _until(lambda: worker.received == ["r0", "r1", "r2", "r3"])
        assert counted.writes == 2
        links.send_generation(endpoint, GENERATE_CANCEL_FRAME, b"")  # r1-r3 unanswered; a generation: at once
        assert counted.writes == 3

        for request_id in ("r1", "r2", "r3"):
            worker.answer(request_id)
        await _until(lambda: len(replies) == 4)
        send("r4")  # all answered: the worker is idle again, and gets it at once
        assert counted.writes == 4
        await _until(lambda: worker.received[-1] == "r4")
    finally:
        await links.close()
        worker.close()
        context.destroy(linger=0)
