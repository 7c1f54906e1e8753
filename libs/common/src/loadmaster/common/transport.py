"""Encryption of the internal hops between hosts (docs/security.md, "Encryption").

The internal credential (`internal_auth`) authenticates; this module encrypts:

- **gRPC: TLS.** With `internal_auth.tls_cert_file` and `tls_key_file` set, every `GrpcServer`
  of the process listens with TLS (server certificate only: callers are authenticated by the
  internal credential, and the gateway's public KServe gRPC takes ordinary TLS clients). With
  `internal_auth.tls_ca_file` set, every channel the process opens (`aio_channel`,
  `internal_auth.sync_channel`, the health waits) is TLS, checking the server's certificate
  against that CA (its name or IP must be in the certificate's subjectAltName).
- **Data ports: CurveZMQ.** With `internal_auth.data_port_curve: true`, a worker's data port
  is a CURVE server and gateways connect as CURVE clients. The server key pair is derived from
  the suite secret (every holder of the secret can compute it, nobody else), so no keys need
  distributing; clients use a fresh key pair per connection and prove who they are with the
  internal credential on every message, as before.

Set up once per process (`setup`, from `loadmaster.common.service`); the default is plaintext.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import zmq
from zmq.utils import z85

from loadmaster.common.config import Settings

__all__ = [
    "Transport",
    "apply_curve_client",
    "apply_curve_server",
    "channel_credentials",
    "current",
    "data_port_keys",
    "from_settings",
    "server_credentials",
    "setup",
]

_CURVE_CONTEXT = b"loadmaster-data-port-curve-v1\n"


@dataclass(frozen=True, slots=True)
class Transport:
    """One process's transport security: PEM bytes for TLS, Z85 keys for CURVE (empty: off)."""

    tls_ca: bytes = b""
    tls_cert: bytes = b""
    tls_key: bytes = b""
    curve_public: bytes = b""
    curve_secret: bytes = b""


_process = Transport()


def data_port_keys(secret: bytes) -> tuple[bytes, bytes]:
    """The data ports' CURVE key pair (public, secret; Z85) derived from the suite secret."""
    raw = hashlib.sha256(_CURVE_CONTEXT + secret).digest()
    secret_key = z85.encode(raw)
    return zmq.curve_public(secret_key), secret_key


def _path(path: Path, base: Path) -> Path:
    return path if path.is_absolute() else base / path


def from_settings(settings: Settings) -> Transport:
    """The transport `settings.internal_auth` describes (files read now: a missing one fails)."""
    config = settings.internal_auth
    base = settings.config_dir

    def read(path: Path | None) -> bytes:
        return b"" if path is None else _path(path, base).read_bytes()

    public = secret_key = b""
    if config.data_port_curve:
        secret = config.secret.get_secret_value() if config.secret is not None else ""
        if not secret and config.secret_file is not None:
            secret = _path(config.secret_file, base).read_text().strip()
        if not secret:
            raise ValueError(
                "internal_auth.data_port_curve needs the suite secret (internal_auth.secret_file)"
            )
        public, secret_key = data_port_keys(secret.encode())
    if bool(config.tls_cert_file) != bool(config.tls_key_file):
        raise ValueError("internal_auth.tls_cert_file and tls_key_file go together")
    return Transport(
        tls_ca=read(config.tls_ca_file),
        tls_cert=read(config.tls_cert_file),
        tls_key=read(config.tls_key_file),
        curve_public=public,
        curve_secret=secret_key,
    )


def setup(transport: Transport) -> None:
    global _process
    _process = transport


def current() -> Transport:
    return _process


def server_credentials() -> grpc.ServerCredentials | None:
    """TLS for this process's gRPC servers, or None (plaintext)."""
    if not _process.tls_cert:
        return None
    return grpc.ssl_server_credentials([(_process.tls_key, _process.tls_cert)])


def channel_credentials() -> grpc.ChannelCredentials | None:
    """TLS for this process's gRPC channels, or None (plaintext)."""
    if not _process.tls_ca:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_process.tls_ca)


def apply_curve_server(socket: zmq.Socket[Any]) -> bool:
    """Make a data port's socket a CURVE server (before bind); False when CURVE is off."""
    if not _process.curve_secret:
        return False
    socket.curve_secretkey = _process.curve_secret
    socket.curve_server = True
    return True


def apply_curve_client(socket: zmq.Socket[Any]) -> bool:
    """Make a socket to a data port a CURVE client (before connect); False when CURVE is off."""
    if not _process.curve_public:
        return False
    public, secret = zmq.curve_keypair()
    socket.curve_serverkey = _process.curve_public
    socket.curve_publickey = public
    socket.curve_secretkey = secret
    return True
