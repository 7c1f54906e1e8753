from __future__ import annotations

import pytest

from loadmaster.model_pool.data_port import advertised_endpoint
from loadmaster.model_pool.server import advertised_grpc_endpoint


@pytest.mark.parametrize(
    ("last", "configured", "expected"),
    [
        ("tcp://127.0.0.1:41234", None, "tcp://127.0.0.1:41234"),
        ("tcp://0.0.0.0:5556", None, "tcp://worker-7:5556"),
        ("tcp://[::]:5556", None, "tcp://worker-7:5556"),
        ("tcp://0.0.0.0:5556", "tcp://pool.example:15556", "tcp://pool.example:15556"),
        ("ipc:///tmp/pool.sock", None, "ipc:///tmp/pool.sock"),
    ],
)
def test_advertised_data_endpoint(last: str, configured: str | None, expected: str) -> None:
    assert advertised_endpoint(last, configured=configured, hostname="worker-7") == expected


@pytest.mark.parametrize(
    ("address", "listen", "port", "expected"),
    [
        ("127.0.0.1:50052", None, 50052, "127.0.0.1:50052"),
        ("127.0.0.1:0", None, 43210, "127.0.0.1:43210"),
        ("model-pool:50052", "0.0.0.0:50052", 50052, "worker-7:50052"),
        ("127.0.0.1:50052", "127.0.0.1:0", 40000, "127.0.0.1:40000"),
        ("[::]:50052", None, 50052, "worker-7:50052"),
    ],
)
def test_advertised_grpc_endpoint(address: str, listen: str | None, port: int, expected: str) -> None:
    assert advertised_grpc_endpoint(address, listen, port, hostname="worker-7") == expected
