"""A gateway's stop ends even when one of its parts left a ZMQ socket of its context open.

`zmq.Context.term()` waits for every socket of the context to be closed, with the event loop
held: one socket a part forgot would hang the stop (and the process) past any grace."""

from __future__ import annotations

import asyncio
import threading

import zmq

from loadmaster.common.config import load_settings
from loadmaster.common.ports import free_port
from loadmaster.gateway.server import build


def test_a_socket_left_open_does_not_hold_the_gateway_s_stop() -> None:
    settings = load_settings(
        None,
        gateway={
            "address": f"127.0.0.1:{free_port()}",
            "http_host": "127.0.0.1",
            "http_port": free_port(),
            "edge": {"bind": f"tcp://127.0.0.1:{free_port()}"},
            "grpc_process": False,
            "shutdown_grace_s": 1.0,
        },
        scheduler={"address": f"127.0.0.1:{free_port()}"},  # nobody there: the link retries
        metrics={"enabled": False},
    )
    stray: list[zmq.Socket[bytes]] = []

    async def start_then_stop() -> None:
        server = await build(settings)
        await server.start()
        socket = server.gateway.context.socket(zmq.DEALER)  # a part that forgot its socket
        socket.connect(f"tcp://127.0.0.1:{free_port()}")
        stray.append(socket)
        await server.stop()

    # In a thread of its own: a stop that hangs holds its event loop, so only a join can time it.
    stopping = threading.Thread(target=asyncio.run, args=(start_then_stop(),), daemon=True)
    stopping.start()
    stopping.join(30)
    assert not stopping.is_alive(), "the gateway's stop hung on a socket left open"
    assert stray and stray[0].closed
