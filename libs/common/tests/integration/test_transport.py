"""Encryption between hosts (`loadmaster.common.transport`): a real TLS GrpcServer and the
suite's channels on 127.0.0.1, and a real CurveZMQ data-port pair."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pki import TestCa

from loadmaster.common import healthcheck, transport
from loadmaster.common.config import load_settings
from loadmaster.common.grpc_client import aio_channel, check_health, wait_for_health_sync
from loadmaster.common.grpc_server import GrpcServer
from loadmaster.common.ports import free_port

SECRET = "s" * 64


@pytest.fixture()
def encrypted(tmp_path: Path) -> Iterator[TestCa]:
    ca = TestCa(tmp_path)
    cert, key = ca.issue("host-a", ["127.0.0.1", "localhost"])
    settings = load_settings(
        None,
        internal_auth={
            "secret": SECRET,
            "tls_ca_file": str(ca.ca_file),
            "tls_cert_file": str(cert),
            "tls_key_file": str(key),
            "data_port_curve": True,
        },
    )
    transport.setup(transport.from_settings(settings))
    try:
        yield ca
    finally:
        transport.setup(transport.Transport())


async def test_grpc_server_speaks_tls_and_refuses_plaintext(
    encrypted: TestCa, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LOADMASTER_INTERNAL_AUTH__TLS_CA_FILE", raising=False)
    address = f"127.0.0.1:{free_port()}"
    server = GrpcServer("test", address)
    await server.start()
    await server._set_all(health_pb2.HealthCheckResponse.SERVING)
    try:
        async with aio_channel(address) as channel:  # TLS, checked against the test CA
            assert await check_health(channel, timeout_s=5)
        await asyncio.to_thread(wait_for_health_sync, address, timeout_s=5)
        async with grpc.aio.insecure_channel(address) as plain:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=3)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # The container probe: TLS with --tls-ca (or its environment variable), refused without.
        probe = healthcheck.main
        assert await asyncio.to_thread(probe, [address, "--tls-ca", str(encrypted.ca_file)]) == 0
        assert await asyncio.to_thread(probe, [address, "--timeout", "1"]) == 1
        # A certificate from another CA is not trusted.
        (encrypted.folder / "other").mkdir()
        other = TestCa(encrypted.folder / "other")
        async with grpc.aio.secure_channel(
            address, grpc.ssl_channel_credentials(other.ca_file.read_bytes())
        ) as untrusting:
            assert not await check_health(untrusting, timeout_s=3)
    finally:
        await server.server.stop(0)


def test_data_port_is_curve_and_a_plain_peer_gets_nothing(encrypted: TestCa) -> None:
    context = zmq.Context()
    try:
        server = context.socket(zmq.ROUTER)
        assert transport.apply_curve_server(server)
        server.setsockopt(zmq.LINGER, 0)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client = context.socket(zmq.DEALER)
        assert transport.apply_curve_client(client)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(f"tcp://127.0.0.1:{port}")
        client.send(b"hello")
        assert server.poll(5000), "the CURVE client's message did not arrive"
        assert server.recv_multipart()[-1] == b"hello"

        plain = context.socket(zmq.DEALER)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(f"tcp://127.0.0.1:{port}")
        plain.send(b"sneaky")
        assert not server.poll(1000), "a plaintext peer got through to a CURVE data port"
        for sock in (server, client, plain):
            sock.close()
    finally:
        context.term()


def test_data_port_keys_come_from_the_secret() -> None:
    public, secret = transport.data_port_keys(SECRET.encode())
    assert transport.data_port_keys(SECRET.encode()) == (public, secret)
    assert transport.data_port_keys(b"t" * 64)[0] != public
    assert zmq.curve_public(secret) == public


def test_curve_without_a_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="data_port_curve needs the suite secret"):
        transport.from_settings(load_settings(None, internal_auth={"data_port_curve": True}))
