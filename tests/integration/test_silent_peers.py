"""A peer that goes silent without closing anything is noticed within the promise (issue 33,
docs/liveness.md): a live gRPC link's stream in both directions (the options of the scheduler's
server and of the session channels), the lease keeper's channel to a real gpu-broker, and the
gateway's data links to workers.

Silence is made by a TCP relay between the two ends that stops moving bytes both ways and
closes nothing, as a frozen process (its kernel still acknowledges TCP) or a cut network
would. The real gRPC core and libzmq on each side, with the suite's options
(loadmaster.common.liveness). Bounds here are generous (a loaded 2-core host); the measured
times are printed, and bench/worker_freeze.py measures the whole suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import zmq
import zmq.asyncio

from loadmaster.client.lease_client import AsyncLeaseClient, Lease
from loadmaster.client.lease_keeper import LeaseKeeper
from loadmaster.common.config import GpuBrokerSettings, GpuSpec, MetricsSettings, Settings
from loadmaster.common.errors import LoadmasterError, UnavailableError
from loadmaster.common.grpc_client import aio_channel
from loadmaster.common.grpc_server import GRPC_OPTIONS
from loadmaster.common.liveness import LIVENESS
from loadmaster.gateway.worker_link import WorkerLinks
from loadmaster.v1 import model_pool_pb2

SLACK_S = 1.0  # on top of each bound: a loaded host's scheduling, the relay's own loop


class SilentRelay:
    """Relays TCP to 127.0.0.1:`target` until `silence()`: then it moves no byte either way
    and closes nothing (`resume()` moves them again). `cut_existing()` silences only the
    connections open now, for good: a new connection gets through (a path that died while
    its peer lives on, reachable anew)."""

    def __init__(self, target: int) -> None:
        self._target = target
        self._moving = asyncio.Event()
        self._moving.set()
        self._connections: list[asyncio.Event] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    def silence(self) -> None:
        self._moving.clear()

    def resume(self) -> None:
        self._moving.set()

    def cut_existing(self) -> None:
        for alive in self._connections:
            alive.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)
        self._writers += [writer, up_writer]
        alive = asyncio.Event()
        alive.set()
        self._connections.append(alive)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(source, sink, alive))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, alive: asyncio.Event
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while True:
                await self._moving.wait()
                await alive.wait()
                data = await source.read(65536)
                if not data:
                    break
                await self._moving.wait()  # what was read as the silence began is held too
                await alive.wait()
                sink.write(data)
                await sink.drain()
        sink.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self._writers:
            writer.close()


@pytest.fixture()
async def relay_to() -> AsyncIterator[Any]:
    relays: list[SilentRelay] = []

    async def make(target: int) -> tuple[SilentRelay, int]:
        relay = SilentRelay(target)
        relays.append(relay)
        return relay, await relay.start()

    yield make
    for relay in relays:
        await relay.close()


# ---- gRPC: a long-lived bidi stream, as the worker's and the gateway's sessions ---------


async def _serve_chat(ended: asyncio.Future[float]) -> tuple[grpc.aio.Server, int]:
    async def chat(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            async for message in requests:
                yield message
        finally:
            if not ended.done():
                ended.set_result(time.monotonic())

    handler = grpc.method_handlers_generic_handler(
        "test.Silent", {"Chat": grpc.stream_stream_rpc_method_handler(chat)}
    )
    live = {**dict(GRPC_OPTIONS), **dict(LIVENESS.grpc_options())}  # as the scheduler's (GrpcServer)
    server = grpc.aio.server(options=list(live.items()))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def test_a_grpc_stream_whose_peer_goes_silent_ends_on_both_sides_within_the_promise(relay_to) -> None:
    server_ended: asyncio.Future[float] = asyncio.get_running_loop().create_future()
    server, port = await _serve_chat(server_ended)
    relay, relay_port = await relay_to(port)
    outgoing: asyncio.Queue[bytes] = asyncio.Queue()

    async def messages() -> AsyncIterator[bytes]:
        while True:
            yield await outgoing.get()

    try:
        async with aio_channel(f"127.0.0.1:{relay_port}", options=LIVENESS.grpc_options()) as channel:
            call = channel.stream_stream("/test.Silent/Chat")(messages())
            await outgoing.put(b"hello")
            assert await asyncio.wait_for(call.read(), 10) == b"hello"
            # Idle but alive for longer than several probes: no ping strikes, no drop.
            await asyncio.sleep(3 * LIVENESS.grpc_probe_every_s + LIVENESS.answer_within_s)
            assert not server_ended.done()
            await outgoing.put(b"still there")
            assert await asyncio.wait_for(call.read(), 5) == b"still there"

            relay.silence()
            silent_at = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as lost:
                await asyncio.wait_for(call.read(), LIVENESS.grpc_client_bound_s + SLACK_S + 5)
            client_s = time.monotonic() - silent_at
            server_s = await asyncio.wait_for(server_ended, 10) - silent_at
    finally:
        await server.stop(0)
    print(f"silent peer noticed: by the client after {client_s:.2f} s, by the server after {server_s:.2f} s")
    assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
    assert client_s <= LIVENESS.grpc_client_bound_s + SLACK_S
    assert server_s <= LIVENESS.grpc_server_bound_s + SLACK_S


async def test_a_grpc_server_whose_loop_is_stuck_keeps_its_streams(relay_to) -> None:
    """Pings are answered by gRPC core's own threads: a server whose event loop is stuck for
    several times the ping deadline (here in pure Python, holding the GIL) is not dropped."""
    ready = threading.Event()
    stuck = threading.Event()
    spinning = threading.Event()
    state: dict[str, Any] = {}

    def serve() -> None:
        async def main() -> None:
            ended: asyncio.Future[float] = asyncio.get_running_loop().create_future()
            server, state["port"] = await _serve_chat(ended)
            state["ended"] = ended
            ready.set()
            while not stuck.is_set():
                await asyncio.sleep(0.01)
            until = time.monotonic() + 3 * LIVENESS.answer_within_s + 1.0
            spinning.set()
            while time.monotonic() < until:  # the loop is stuck: it reads and writes nothing
                pass
            state["unstuck"] = True
            await asyncio.sleep(1.0)
            await server.stop(0)

        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    outgoing: asyncio.Queue[bytes] = asyncio.Queue()

    async def messages() -> AsyncIterator[bytes]:
        while True:
            yield await outgoing.get()

    async with aio_channel(f"127.0.0.1:{state['port']}", options=LIVENESS.grpc_options()) as channel:
        call = channel.stream_stream("/test.Silent/Chat")(messages())
        await outgoing.put(b"a")
        assert await asyncio.wait_for(call.read(), 10) == b"a"
        stuck.set()
        assert spinning.wait(10)
        await outgoing.put(b"b")
        assert await asyncio.wait_for(call.read(), 20) == b"b"  # answered once the loop runs again
        assert state.get("unstuck") and not state["ended"].done()
        call.cancel()
    thread.join(10)


# ---- the gateway's data links to workers ------------------------------------------------


class _Worker:
    """A data port that answers every InferRequest with an empty InferResponse."""

    def __init__(self, context: zmq.asyncio.Context) -> None:
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self._task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            identity, _, envelope, payload = await self.socket.recv_multipart()
            request = model_pool_pb2.InferRequest.FromString(envelope)
            reply = model_pool_pb2.InferResponse(request_id=request.request_id, worker_id="w")
            await self.socket.send_multipart([identity, b"", reply.SerializeToString(), payload])

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.socket.close(0)


class _Links:
    def __init__(self, context: zmq.asyncio.Context) -> None:
        self.replies: asyncio.Queue[str] = asyncio.Queue()
        self.lost: asyncio.Queue[tuple[str, float]] = asyncio.Queue()
        self.links = WorkerLinks(
            context,
            lambda reply, _payload: self.replies.put_nowait(reply.request_id),
            on_lost=lambda endpoint: self.lost.put_nowait((endpoint, time.monotonic())),
        )

    def send(self, endpoint: str, request_id: str) -> None:
        envelope = model_pool_pb2.InferRequest(request_id=request_id, model_id="m").SerializeToString()
        self.links.send(endpoint, envelope, b"payload")

    async def round_trip(self, endpoint: str, request_id: str) -> None:
        self.send(endpoint, request_id)
        assert await asyncio.wait_for(self.replies.get(), 10) == request_id


@pytest.fixture()
async def zmq_context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def test_a_worker_that_goes_silent_is_lost_its_endpoint_refused_then_linked_anew(
    relay_to, zmq_context
) -> None:
    worker = _Worker(zmq_context)
    relay, relay_port = await relay_to(worker.port)
    endpoint = f"tcp://127.0.0.1:{relay_port}"
    links = _Links(zmq_context)
    try:
        await links.round_trip(endpoint, "r1")
        await asyncio.sleep(3 * LIVENESS.zmtp_probe_every_s)  # idle, heartbeats answered: still up
        assert links.links.connected == [endpoint] and links.lost.empty()

        relay.silence()
        silent_at = time.monotonic()
        links.send(endpoint, "r2")  # held by the silence, like a request on a frozen worker
        lost, lost_at = await asyncio.wait_for(links.lost.get(), LIVENESS.zmtp_bound_s + SLACK_S + 5)
        print(f"silent worker noticed after {lost_at - silent_at:.2f} s")
        assert lost == endpoint
        assert lost_at - silent_at <= LIVENESS.zmtp_bound_s + SLACK_S
        with pytest.raises(UnavailableError, match="was lost"):  # at once, no new link yet
            links.send(endpoint, "r3")

        relay.resume()
        await asyncio.sleep(LIVENESS.refuse_lost_s - (time.monotonic() - lost_at) + 0.05)
        await links.round_trip(endpoint, "r4")  # a new link, a new TCP connection
        assert links.links.connected == [endpoint]
    finally:
        await links.links.close()
        await worker.close()


async def test_a_worker_that_never_answers_the_handshake_is_lost_within_connect_within_s(
    zmq_context,
) -> None:
    """Its kernel accepts the TCP connection (a frozen process, a listen backlog), nothing more."""
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)
    endpoint = f"tcp://127.0.0.1:{mute.getsockname()[1]}"
    links = _Links(zmq_context)
    try:
        opened_at = time.monotonic()
        links.send(endpoint, "r1")
        lost, lost_at = await asyncio.wait_for(links.lost.get(), LIVENESS.connect_within_s + SLACK_S + 5)
        assert lost == endpoint
        assert LIVENESS.connect_within_s - 0.05 <= lost_at - opened_at <= LIVENESS.connect_within_s + SLACK_S
        with pytest.raises(UnavailableError):
            links.send(endpoint, "r2")
    finally:
        await links.links.close()
        mute.close()


async def test_a_worker_named_by_host_name_is_linked_at_its_address(zmq_context) -> None:
    worker = _Worker(zmq_context)
    endpoint = f"tcp://localhost:{worker.port}"
    links = _Links(zmq_context)
    try:
        for index in range(3):  # the first ones wait for the name: none is lost or reordered
            links.send(endpoint, f"r{index}")
        assert [await asyncio.wait_for(links.replies.get(), 10) for _ in range(3)] == ["r0", "r1", "r2"]
        assert links.links.connected == [endpoint] and links.lost.empty()
    finally:
        await links.links.close()
        await worker.close()


_LOCAL_WORKER = """
import asyncio, sys
from loadmaster.common import local_link
from loadmaster.v1 import model_pool_pb2

async def main():
    listener = local_link.listen(local_link.local_name(sys.argv[1]))
    loop = asyncio.get_running_loop()
    links = []

    def answer(link, frames):
        request = model_pool_pb2.InferRequest.FromString(frames[1])
        reply = model_pool_pb2.InferResponse(request_id=request.request_id, worker_id="w")
        link[0].send([b"", reply.SerializeToString(), frames[2]])

    def accept():
        conn, _ = listener.accept()
        conn.setblocking(False)
        link = []
        link.append(local_link.FrameSocket(conn, lambda f: answer(link, f), print, name="w"))
        links.append(link)

    loop.add_reader(listener.fileno(), accept)
    print("listening", flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="local links are Linux's (abstract Unix sockets)")
async def test_a_local_worker_whose_process_stops_is_lost_within_the_heartbeat_bound(zmq_context) -> None:
    """A worker on this host is reached over its local link, which has no heartbeat a native
    thread answers: its process seen stopped (SIGSTOP) ends the link as unanswered ZMTP
    heartbeats do, within `zmtp_bound_s`."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    endpoint = f"tcp://127.0.0.1:{probe.getsockname()[1]}"  # held: no other worker takes the port
    worker = subprocess.Popen(
        [sys.executable, "-c", _LOCAL_WORKER, endpoint], stdout=subprocess.PIPE, text=True
    )
    links = _Links(zmq_context)
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "listening"
        await links.round_trip(endpoint, "r1")
        assert links.links.connected == [endpoint]
        assert links.links._links[endpoint].local is not None  # not ZMQ: nothing listens there
        await asyncio.sleep(3.4 * LIVENESS.zmtp_probe_every_s)  # watched, running: still up
        assert links.lost.empty()

        os.kill(worker.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        links.send(endpoint, "r2")  # held by the stop, like a request on a frozen worker
        lost, lost_at = await asyncio.wait_for(links.lost.get(), LIVENESS.zmtp_bound_s + SLACK_S + 5)
        print(f"stopped local worker noticed after {lost_at - stopped_at:.2f} s")
        assert lost == endpoint
        assert lost_at - stopped_at <= LIVENESS.zmtp_bound_s + SLACK_S
        with pytest.raises(UnavailableError, match="was lost"):
            links.send(endpoint, "r3")
    finally:
        await links.links.close()
        worker.kill()
        worker.wait(10)
        probe.close()


# ---- the lease keeper's channel to the gpu-broker -----------------------------------------


# Slow (make test-all): it waits out a lease's life; the stream case above checks the same keepalive.
@pytest.mark.slow
async def test_the_lease_keeper_leaves_a_silent_broker_connection_before_its_lease_lapses(
    relay_to, redis_url: str
) -> None:
    """The keeper's connection goes silent while the broker lives on and a new connection would
    get through (a path that died): keepalive drops the silent one in time for a renewal over a
    new one before the holder's deadline. (With the keepalive of before issue 33, a renewal
    waited on the dead connection for a minute and the lease lapsed.)"""
    from loadmaster.gpu_broker.server import build

    ttl_s = 6.0  # renewed every 1.2 s; the holder's deadline 4.8 s after a renewal's send
    settings = Settings(
        redis_url=redis_url,
        gpu_broker=GpuBrokerSettings(
            listen="127.0.0.1:0",
            key_prefix=f"silent-{uuid.uuid4().hex[:12]}",
            use_nvml=False,
            reserve_mb=0,
            declared={"local": [GpuSpec(index=0, total_mb=1_000)]},
        ),
        metrics=MetricsSettings(enabled=False),
    )
    server = await build(settings)
    port = await server.start()
    relay, relay_port = await relay_to(port)
    address = f"127.0.0.1:{relay_port}"
    lost: list[str] = []

    def on_lost(key: str, lease: Lease, error: LoadmasterError) -> None:  # the keeper's thread
        lost.append(error.message)

    keeper = LeaseKeeper(
        lambda: AsyncLeaseClient(address, holder="w", node="local"), on_lost=on_lost, reacquire=False
    )
    keeper.start()
    try:
        lease = await asyncio.wrap_future(
            keeper.run(lambda client: client.acquire(mb=10, ttl_s=ttl_s, labels={"model": "m"}))
        )
        keeper.keep("m", lease, ttl_s=ttl_s)
        await asyncio.sleep(1.5)  # renewed at least once on the first connection
        relay.cut_existing()
        # past the holder's deadline (at most 4.5 s after the cut) and two renewals more: had the
        # keeper stayed on the dead connection, the lease would have lapsed
        await asyncio.sleep(ttl_s + 2.4)
        assert lost == [] and keeper.live("m"), lost
    finally:
        await asyncio.to_thread(keeper.close)
        await server.stop()
