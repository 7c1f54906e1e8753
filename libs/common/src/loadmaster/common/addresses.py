"""What kind of address a gRPC address or a ZMQ endpoint is: loopback, or reachable from elsewhere.

One rule for every check that depends on it (the bind refusal without internal auth, the
gateway's warning about front ends exposed without auth, shared memory only to local workers).
"""

from __future__ import annotations

import ipaddress

__all__ = ["host_of", "is_local", "is_loopback"]

_LOCAL_SCHEMES = ("ipc://", "inproc://", "unix:", "unix-abstract:")


def host_of(address: str) -> str | None:
    """The host of `host:port`, `tcp://host:port` or `scheme://host:port`; None for transports
    that never leave this machine (ipc://, inproc://, unix sockets)."""
    if address.startswith(_LOCAL_SCHEMES):
        return None
    _, _, rest = address.rpartition("://")
    host, _, _ = rest.rpartition(":")
    return host.strip("[]")


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address; a host name, `*` or an interface name is not."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_local(address: str) -> bool:
    """Whether `address` can only be reached from this machine."""
    host = host_of(address)
    return host is None or is_loopback(host)
