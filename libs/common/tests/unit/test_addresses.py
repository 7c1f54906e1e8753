from __future__ import annotations

import pytest

from loadmaster.common.addresses import host_of, is_local, is_loopback


@pytest.mark.parametrize(
    ("address", "host", "local"),
    [
        ("127.0.0.1:50051", "127.0.0.1", True),
        ("[::1]:8001", "::1", True),
        ("localhost:8001", "localhost", True),
        ("tcp://127.0.0.1:5556", "127.0.0.1", True),
        ("tcp://0.0.0.0:5555", "0.0.0.0", False),
        ("tcp://*:5555", "*", False),
        ("0.0.0.0:50052", "0.0.0.0", False),
        ("scheduler:50051", "scheduler", False),  # a host name may resolve anywhere
        ("10.1.2.3:8001", "10.1.2.3", False),
        ("ipc:///tmp/worker.sock", None, True),
        ("inproc://x", None, True),
        ("unix:/run/loadmaster.sock", None, True),
    ],
)
def test_addresses_are_told_apart(address: str, host: str | None, local: bool) -> None:
    assert host_of(address) == host
    assert is_local(address) is local


def test_loopback_hosts() -> None:
    assert is_loopback("127.0.0.5") and is_loopback("[::1]") and is_loopback("localhost")
    assert not is_loopback("") and not is_loopback("eth0") and not is_loopback("192.168.1.2")
