"""Run by test_worker_link_dns.py inside a private network and mount namespace whose one DNS
server never answers: while a worker's host name is being resolved, how long does a round
trip take on another socket of the same ZMQ context? Prints one JSON line.

`links`: the gateway's WorkerLinks (names resolved off the loop and off libzmq's I/O thread).
`libzmq`: a DEALER connected to the name itself, as the gateway did before issue 33: libzmq
resolves it with a blocking getaddrinfo on the I/O thread that every socket shares.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from typing import Any

import zmq
import zmq.asyncio

from loadmaster.gateway.worker_link import WorkerLinks
from loadmaster.v1 import model_pool_pb2

DEAD = "tcp://gone-worker.invalid:5556"
WATCH_S = 3.0


async def _echo(router: zmq.asyncio.Socket) -> None:
    while True:
        identity, _, envelope, payload = await router.recv_multipart()
        request = model_pool_pb2.InferRequest.FromString(envelope)
        reply = model_pool_pb2.InferResponse(request_id=request.request_id, worker_id="w")
        await router.send_multipart([identity, b"", reply.SerializeToString(), payload])


async def main(mode: str) -> dict[str, Any]:
    dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dns.bind(("127.0.0.1", 53))  # takes every query, answers none
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    good = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    echo = asyncio.create_task(_echo(router))
    replies: asyncio.Queue[str] = asyncio.Queue()
    lost: list[float] = []
    envelope = model_pool_pb2.InferRequest(request_id="r", model_id="m").SerializeToString()
    if mode == "links":
        links = WorkerLinks(
            context,
            lambda reply, _payload: replies.put_nowait(reply.request_id),
            on_lost=lambda _endpoint: lost.append(time.monotonic()),
        )

        async def round_trip() -> None:
            links.send(good, envelope, b"")
            await replies.get()

        await round_trip()
        started = time.monotonic()
        links.send(DEAD, envelope, b"")
    else:
        dealer = context.socket(zmq.DEALER)
        dealer.connect(good)

        async def round_trip() -> None:
            await dealer.send_multipart([b"", envelope, b""])
            await dealer.recv_multipart()

        await round_trip()
        dead = context.socket(zmq.DEALER)
        dead.setsockopt(zmq.LINGER, 0)
        started = time.monotonic()
        dead.connect(DEAD)
    slowest = 0.0
    trips = 0
    while time.monotonic() - started < WATCH_S:
        await asyncio.sleep(0.05)
        sent = time.monotonic()
        await asyncio.wait_for(round_trip(), 30)
        slowest = max(slowest, time.monotonic() - sent)
        trips += 1
    echo.cancel()
    if mode == "links":
        await links.close()
    context.destroy(linger=0)
    return {
        "mode": mode,
        "slowest_round_trip_s": round(slowest, 3),
        "round_trips": trips,
        "dead_link_lost_after_s": round(lost[0] - started, 3) if lost else None,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))), flush=True)
