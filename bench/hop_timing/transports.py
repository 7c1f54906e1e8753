"""One gateway ↔ worker round trip on each transport, between two processes, both ends asyncio.

ZMQ DEALER/ROUTER over TCP and over IPC (what the data links use) against a length-prefixed
Unix socket read by the loop itself (asyncio streams, and a bare Protocol). A 200-byte message
each way, 5,000 round trips after 500 to warm up; prints the p50 of each.

    .venv/bin/python bench/hop_timing/transports.py
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

from loadmaster.common.ports import free_port

ROUND_TRIPS = 5000
WARMUP = 500
MESSAGE = b"x" * 200


def _p50_us(samples: list[float]) -> float:
    ordered = sorted(samples[WARMUP:])
    return ordered[len(ordered) // 2] * 1e6


def zmq_echo(address: str) -> None:
    import zmq
    import zmq.asyncio

    async def main() -> None:
        socket = zmq.asyncio.Context().socket(zmq.ROUTER)
        socket.bind(address)
        while True:
            await socket.send_multipart(await socket.recv_multipart())

    asyncio.run(main())


async def zmq_round_trips(address: str) -> float:
    import zmq
    import zmq.asyncio

    socket = zmq.asyncio.Context().socket(zmq.DEALER)
    socket.connect(address)
    samples = []
    for _ in range(WARMUP + ROUND_TRIPS):
        started = time.perf_counter()
        await socket.send_multipart([b"", MESSAGE])
        await socket.recv_multipart()
        samples.append(time.perf_counter() - started)
    return _p50_us(samples)


def unix_echo(path: str) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            size = int.from_bytes(await reader.readexactly(4), "little")
            writer.write(size.to_bytes(4, "little") + await reader.readexactly(size))

    async def main() -> None:
        server = await asyncio.start_unix_server(handle, path)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


async def unix_round_trips(path: str) -> float:
    reader, writer = await asyncio.open_unix_connection(path)
    samples = []
    for _ in range(WARMUP + ROUND_TRIPS):
        started = time.perf_counter()
        writer.write(len(MESSAGE).to_bytes(4, "little") + MESSAGE)
        await reader.readexactly(int.from_bytes(await reader.readexactly(4), "little"))
        samples.append(time.perf_counter() - started)
    return _p50_us(samples)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="loadmaster-transports-") as folder:
        cases = [
            ("ZMQ over TCP", zmq_echo, zmq_round_trips, f"tcp://127.0.0.1:{free_port()}"),
            ("ZMQ over IPC", zmq_echo, zmq_round_trips, f"ipc://{Path(folder) / 'zmq.sock'}"),
            ("Unix socket, asyncio streams", unix_echo, unix_round_trips, str(Path(folder) / "unix.sock")),
        ]
        for name, echo, round_trips, address in cases:
            server = mp.get_context("spawn").Process(target=echo, args=(address,), daemon=True)
            server.start()
            try:
                time.sleep(1.0)  # the echo process imports and binds
                print(f"{name:30s} round trip p50 {asyncio.run(round_trips(address)):7.1f} us", flush=True)
            finally:
                server.terminate()
                server.join(5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
