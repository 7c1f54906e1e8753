"""CurveZMQ for the edge: the server socket's keys and the allowed client keys (ZAP handler)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from loadmaster.common.gateway_config import CurveSettings

__all__ = ["AllowedClients", "EdgeCurve"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AllowedClients:
    """ZAP credentials provider: a client may connect when its public key is listed (any if none)."""

    keys: frozenset[bytes]

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = not self.keys or key in self.keys
        if not allowed:
            log.warning("edge: refused a CURVE client whose public key is not allowed")
        return allowed


class EdgeCurve:
    """Starts the ZAP authenticator and makes a socket a CURVE server (no-op when not configured)."""

    def __init__(self, settings: CurveSettings, context: zmq.asyncio.Context) -> None:
        self._settings = settings
        self._context = context
        self._authenticator: AsyncioAuthenticator | None = None

    @property
    def enabled(self) -> bool:
        return self._settings.enabled

    def apply(self, socket: zmq.Socket) -> None:  # type: ignore[type-arg]
        if not self.enabled:
            return
        if self._authenticator is None:
            self._authenticator = AsyncioAuthenticator(self._context)
            self._authenticator.start()
            allowed = frozenset(key.encode() for key in self._settings.allowed_client_keys)
            self._authenticator.configure_curve_callback("*", AllowedClients(allowed))
        secret = self._settings.server_secret_key.encode()
        public = self._settings.server_public_key.encode() or zmq.curve_public(secret)
        socket.curve_secretkey = secret
        socket.curve_publickey = public
        socket.curve_server = True

    def stop(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
