"""A warning at start when a front end listens beyond loopback without authentication."""

from __future__ import annotations

import logging

from loadmaster.common.addresses import host_of, is_loopback
from loadmaster.common.gateway_config import GatewaySettings

__all__ = ["exposed_without_auth", "is_loopback", "warn_if_exposed"]

log = logging.getLogger(__name__)


def _host_of(address: str) -> str:
    return host_of(address) or "localhost"  # ipc:// and the like never leave the machine


def exposed_without_auth(settings: GatewaySettings) -> list[str]:
    """Front ends that listen on a non-loopback address with no authentication configured."""
    exposed: list[str] = []
    has_keys = bool(settings.auth.api_keys) or settings.auth.oidc.enabled  # keys or tokens
    if not has_keys and not is_loopback(settings.http_host):
        exposed.append(f"HTTP on {settings.http_host}:{settings.http_port}")
    if not has_keys and not is_loopback(_host_of(settings.listen_address)):
        exposed.append(f"gRPC on {settings.listen_address}")
    if not settings.auth.curve.enabled and not is_loopback(_host_of(settings.edge.bind)):
        exposed.append(f"edge on {settings.edge.bind}")
    gr00t = settings.gr00t
    if gr00t.enabled and not has_keys and not is_loopback(_host_of(gr00t.bind)):
        exposed.append(f"GR00T on {gr00t.bind}")
    return exposed


def warn_if_exposed(settings: GatewaySettings) -> None:
    for front_end in exposed_without_auth(settings):
        log.warning(
            "%s is reachable beyond this machine without authentication; configure "
            "gateway.auth (api_keys, curve) — `loadmaster keys` makes them",
            front_end,
        )
