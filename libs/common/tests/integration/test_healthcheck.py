"""`python -m loadmaster.common.healthcheck`: exit 0 only when the server says SERVING."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import AsyncIterator

import pytest
from grpc_health.v1 import health_pb2

from loadmaster.common import healthcheck
from loadmaster.common.grpc_server import GrpcServer
from loadmaster.v1 import metrics_pb2_grpc

SERVICE = "loadmaster.v1.MetricsService"


@pytest.fixture()
async def server() -> AsyncIterator[GrpcServer]:
    srv = GrpcServer("probed", "127.0.0.1:0", grace_s=0.1)
    srv.add_service(
        SERVICE,
        metrics_pb2_grpc.add_MetricsServiceServicer_to_server,
        metrics_pb2_grpc.MetricsServiceServicer(),
    )
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


async def probe(*argv: str) -> int:
    # The probe is synchronous gRPC: run it off the loop that serves the server.
    return await asyncio.to_thread(healthcheck.main, list(argv))


async def test_serving_exits_0(server: GrpcServer) -> None:
    assert await probe(f"127.0.0.1:{server.port}") == 0
    assert await probe(f"127.0.0.1:{server.port}", "--service", SERVICE, "--timeout", "2") == 0


async def test_not_serving_exits_1(server: GrpcServer) -> None:
    await server.health.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    assert await probe(f"127.0.0.1:{server.port}", "--service", SERVICE) == 1
    await server.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert await probe(f"127.0.0.1:{server.port}") == 1


async def test_unknown_service_exits_1(server: GrpcServer) -> None:
    assert await probe(f"127.0.0.1:{server.port}", "--service", "no.such.Service") == 1


async def test_unreachable_exits_1_within_the_timeout() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await probe(f"127.0.0.1:{port}", "--timeout", "1") == 1
    assert loop.time() - started < 3.0


def test_usage_errors_exit_1_not_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert healthcheck.main([]) == 1
    assert healthcheck.main(["127.0.0.1:1", "--timeout", "soon"]) == 1
    assert "usage" in capsys.readouterr().err


async def test_the_module_entry_point_is_what_docker_runs(server: GrpcServer) -> None:
    async def run(*argv: str) -> int:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "loadmaster.common.healthcheck",
            *argv,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        return await asyncio.wait_for(process.wait(), 30)

    assert await run(f"127.0.0.1:{server.port}") == 0
    assert await run(f"127.0.0.1:{server.port}", "--service", "no.such.Service") == 1
