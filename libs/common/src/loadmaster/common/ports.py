"""Free loopback ports for processes that bind later (test suites, `loadmaster up`, benchmarks).

A port the kernel hands out for `bind(("127.0.0.1", 0))` comes from its ephemeral range,
the same range it draws the local port of every outgoing connection from. Between picking
such a port and the server binding it, any connection this machine opens (to Redis, to a
service that just started) may be given it, and the server then fails with "Address
already in use". So on Linux the ports come from below the ephemeral range
(`/proc/sys/net/ipv4/ip_local_port_range`), where only an explicit bind can take them, in
order from a random start so the ports one process hands out do not repeat. Elsewhere, or
when that range is too small, the kernel picks.
"""

from __future__ import annotations

import itertools
import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["free_port"]

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000  # below this, well-known and registered services are common
_MIN_PORTS = 1_000  # a smaller range than this below the ephemeral one: let the kernel pick
_ATTEMPTS = 200

_random = random.SystemRandom()  # not the generator tests seed
_lock = threading.Lock()
_candidates: Iterator[int] | None = None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing is bound to now, and that no outgoing connection
    will be given meanwhile (see the module's docstring)."""
    with _lock:
        candidates = _ports()
        if candidates is not None:
            for port in itertools.islice(candidates, _ATTEMPTS):
                if _bindable(host, port):
                    return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _ports() -> Iterator[int] | None:
    """The process's cycle through the ports below the ephemeral range (None: not known)."""
    global _candidates
    if _candidates is None:
        try:
            low = int(_EPHEMERAL_RANGE.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        if low - _LOWEST < _MIN_PORTS:
            return None
        start = _random.randrange(_LOWEST, low)
        _candidates = itertools.cycle(itertools.chain(range(start, low), range(_LOWEST, start)))
    return _candidates


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
