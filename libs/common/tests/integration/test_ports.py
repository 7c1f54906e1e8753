"""free_port: ports from below the ephemeral range, none handed out twice, a port in use skipped."""

import socket
from pathlib import Path

import pytest

from loadmaster.common import ports
from loadmaster.common.ports import free_port


@pytest.fixture
def fresh_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts its own cycle through the ports (the module keeps one per process)."""
    monkeypatch.setattr(ports, "_candidates", None)


@pytest.mark.skipif(not Path("/proc/sys/net/ipv4/ip_local_port_range").exists(), reason="Linux only")
def test_ports_come_from_below_the_ephemeral_range_and_do_not_repeat(fresh_cycle: None) -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picked = [free_port() for _ in range(50)]
    assert all(10_000 <= port < low for port in picked)
    assert len(set(picked)) == len(picked)


def test_a_port_in_use_is_skipped(fresh_cycle: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        # A range that starts at the held port: the cycle's first candidate is taken.
        monkeypatch.setattr(ports, "_LOWEST", taken)
        monkeypatch.setattr(ports, "_MIN_PORTS", 1)
        range_file = tmp_path / "ip_local_port_range"
        range_file.write_text(f"{taken + 3}\t{taken + 100}\n")
        monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", range_file)
        monkeypatch.setattr(ports, "_random", _First())
        port = free_port()
    assert port != taken
    assert taken < port < taken + 3


def test_without_a_known_range_the_kernel_picks(
    fresh_cycle: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", tmp_path / "missing")
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # free as promised


class _First:
    """A stand-in for the module's random source: the cycle starts at the range's start."""

    def randrange(self, start: int, stop: int) -> int:
        return start
