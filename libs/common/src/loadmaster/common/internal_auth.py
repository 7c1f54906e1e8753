"""Internal credentials: every gRPC call between services and every data-port message
carries one, and the receiver knows who sent it (docs/security.md has the design).

A process has an `Identity` (service name + instance id) and holds the suite secret (or an
identity key derived from it). It proves the identity with an HMAC-SHA256 under that key
(`loadmaster.common.credentials`, where the MACs are made and checked):

- gRPC: metadata `x-loadmaster-identity: <service>/<instance>` and
  `x-loadmaster-auth: <unix_ns>.<hex mac>`, the MAC over the identity, the full method
  name and the time. The receiver accepts it within `max_clock_skew_s`.
- data port: `InferRequest.metadata["loadmaster-auth"] = "<identity> <unix_ns> <hex mac>"`,
  the MAC over the identity, the request id and the time; a message seen before within
  the window is refused (replay).
- admin RPCs (`ADMIN_METHODS`) also need `x-loadmaster-admin: <admin token>`, checked
  against the token's SHA-256, when an admin token is configured.

The process's credentials are set once in `run_service` (`setup`), like tracing:
`GrpcServer` adds `server_interceptors()`, `aio_channel` adds `client_interceptors()`,
the gateway signs data-port envelopes with `current()` and the worker verifies them.
With no secret configured nothing is added or checked, and `check_listen` refuses to
bind beyond loopback unless `insecure: true` says that is meant.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from loadmaster.common import transport
from loadmaster.common.addresses import is_local
from loadmaster.common.config import InternalAuthSettings, Settings
from loadmaster.common.credentials import (
    ADMIN_HEADER,
    AUTH_HEADER,
    IDENTITY_HEADER,
    IDENTITY_KEY_PREFIX,
    Credentials,
    Identity,
)
from loadmaster.common.errors import (
    ERROR_CODE_TRAILER,
    LoadmasterError,
    UnauthenticatedError,
)

__all__ = [
    "RUN_DIR",
    "InsecureBindError",
    "ServerAuthInterceptor",
    "SyncClientAuthInterceptor",
    "auth_interceptors",
    "caller",
    "check_listen",
    "client_credentials",
    "client_interceptors",
    "credentials_from_settings",
    "current",
    "ensure_run_secrets",
    "insecure_allowed",
    "log_refusal",
    "server_interceptors",
    "setup",
    "setup_client",
    "sync_channel",
]

log = logging.getLogger(__name__)

_PROTECTED_PREFIX = "/loadmaster.v1."  # the public KServe API (package `inference`) keeps API keys


class InsecureBindError(RuntimeError):
    """A port beyond loopback without internal auth, and `insecure: true` not set."""


# ---- process-wide setup -------------------------------------------------------


class _Process(NamedTuple):
    credentials: Credentials | None
    insecure: bool


_process = _Process(None, False)


def _read(path: Path, base: Path) -> str:
    path = path if path.is_absolute() else base / path
    return path.read_text().strip()


def credentials_from_settings(settings: Settings, identity: Identity) -> Credentials | None:
    """The credentials `settings.internal_auth` describes, or None when no secret is configured."""
    config: InternalAuthSettings = settings.internal_auth
    secret = config.secret.get_secret_value() if config.secret is not None else ""
    if not secret and config.secret_file is not None:
        secret = _read(config.secret_file, settings.config_dir)
    if not secret:
        return None
    admin_token = config.admin_token.get_secret_value() if config.admin_token is not None else ""
    if not admin_token and config.admin_token_file is not None:
        admin_token = _read(config.admin_token_file, settings.config_dir)
    if secret.startswith(IDENTITY_KEY_PREFIX):  # speaks for the identity the key names
        return Credentials.from_identity_key(
            secret, admin_token=admin_token, max_clock_skew_s=config.max_clock_skew_s
        )
    return Credentials(
        secret.encode(),
        identity,
        admin_token=admin_token,
        admin_sha256=config.admin_token_sha256,
        max_clock_skew_s=config.max_clock_skew_s,
    )


RUN_DIR = ".loadmaster"  # next to the config file: what `loadmaster up` generates


def ensure_run_secrets(config_dir: Path) -> tuple[Path, Path]:
    """The suite secret and admin token files `loadmaster up` uses, made (random, mode 0600)
    under `config_dir/.loadmaster/` when absent and kept across runs, so CLI commands run
    with the same config find them."""
    run_dir = config_dir / RUN_DIR
    run_dir.mkdir(mode=0o700, exist_ok=True)
    paths = (run_dir / "internal.secret", run_dir / "admin.token")
    for path in paths:
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_hex(32) + "\n")
    return paths


def setup(credentials: Credentials | None, *, insecure: bool = False) -> None:
    """Make `credentials` this process's (None: no internal auth); `insecure` allows wide binds."""
    global _process
    _process = _Process(credentials, insecure)


def client_credentials(settings: Settings, identity: Identity) -> Credentials | None:
    """The credentials a command-line client uses: those `settings` names, else the ones
    `loadmaster up` made next to the same config file (`ensure_run_secrets`), if any."""
    credentials = credentials_from_settings(settings, identity)
    run_dir = settings.config_dir / RUN_DIR
    if credentials is None and (run_dir / "internal.secret").exists():
        admin_file = run_dir / "admin.token"
        credentials = Credentials(
            (run_dir / "internal.secret").read_text().strip().encode(),
            identity,
            admin_token=admin_file.read_text().strip() if admin_file.exists() else "",
            max_clock_skew_s=settings.internal_auth.max_clock_skew_s,
        )
    return credentials


def setup_client(settings: Settings, identity: Identity) -> None:
    """`setup` for a command-line client, with `client_credentials`."""
    setup(client_credentials(settings, identity), insecure=settings.internal_auth.insecure)


def current() -> Credentials | None:
    return _process.credentials


def insecure_allowed() -> bool:
    return _process.insecure


def check_listen(name: str, address: str) -> None:
    """Refuse a bind beyond loopback while this process has no internal auth (unless insecure)."""
    if is_local(address) or _process.credentials is not None or _process.insecure:
        return
    raise InsecureBindError(
        f"{name}: refusing to listen on {address} without internal auth: any process that reaches "
        "it could act as a service. Configure internal_auth.secret_file (or "
        "LOADMASTER_INTERNAL_AUTH__SECRET; `loadmaster up` makes one), bind 127.0.0.1, or set "
        "internal_auth.insecure: true to accept the risk"
    )


# ---- refusals are logged, naming the caller, at a bounded rate ------------------


class _RefusalLog:
    def __init__(self, per_s: float = 10.0, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._per_s = per_s
        self._monotonic = monotonic
        self._window = 0.0
        self._count = 0
        self._suppressed = 0

    def __call__(self, what: str, peer: str, claimed: str, reason: str) -> None:
        now = self._monotonic()
        if now - self._window >= 1.0:
            if self._suppressed:
                log.warning("%d more internal-auth refusal(s) not logged", self._suppressed)
            self._window, self._count, self._suppressed = now, 0, 0
        self._count += 1
        if self._count > self._per_s:
            self._suppressed += 1
            return
        log.warning(
            "refused %s from %s (identity: %s): %s", what, peer or "unknown peer", claimed or "none", reason
        )


log_refusal = _RefusalLog()


# ---- gRPC interceptors ------------------------------------------------------------


_CREDENTIAL_HEADERS = (IDENTITY_HEADER, AUTH_HEADER, ADMIN_HEADER)


def _single_valued(pairs: Any) -> dict[str, str]:
    """The call's metadata as a dict; a credential header given twice is refused (one copy
    could be verified while a handler reads the other)."""
    metadata: dict[str, str] = {}
    for key, value in pairs or ():
        key = str(key)
        if key in metadata and key in _CREDENTIAL_HEADERS:
            raise UnauthenticatedError(f"the credential header {key} appears more than once")
        metadata[key] = str(value)
    return metadata


def caller(context: grpc.aio.ServicerContext) -> Identity | None:
    """The identity the call was made with (verified by `ServerAuthInterceptor` when auth is on,
    which also refuses a call that repeats it)."""
    try:
        claimed = _single_valued(context.invocation_metadata()).get(IDENTITY_HEADER)
        return Identity.parse(claimed) if claimed is not None else None
    except UnauthenticatedError:
        return None


def _refusing(handler: grpc.RpcMethodHandler, method: str, claimed: str, error: LoadmasterError) -> Any:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        log_refusal(method, context.peer(), claimed, error.message)
        await context.abort(
            error.grpc_code, error.message, trailing_metadata=((ERROR_CODE_TRAILER, str(error.code)),)
        )

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            refuse, handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            refuse, handler.request_deserializer, handler.response_serializer
        )
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            refuse, handler.request_deserializer, handler.response_serializer
        )
    return grpc.stream_stream_rpc_method_handler(
        refuse, handler.request_deserializer, handler.response_serializer
    )


class ServerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Verifies the internal credential of every `loadmaster.v1` call before its handler runs;
    health, reflection and the public KServe API pass untouched."""

    def __init__(self, credentials: Credentials) -> None:
        self._credentials = credentials

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if not method.startswith(_PROTECTED_PREFIX):
            return await continuation(handler_call_details)
        metadata: dict[str, str] = {}
        try:
            metadata = _single_valued(handler_call_details.invocation_metadata)
            self._credentials.verify_call(metadata, method)
        except LoadmasterError as error:
            handler = await continuation(handler_call_details)
            if handler is None:
                return handler
            return _refusing(handler, method, metadata.get(IDENTITY_HEADER, ""), error)
        return await continuation(handler_call_details)


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    credentials = _process.credentials
    if credentials is not None and not credentials.can_verify:
        raise RuntimeError(f"{credentials.identity}: a server needs the suite secret, not an identity key")
    return [ServerAuthInterceptor(credentials)] if credentials is not None else []


def _method_name(method: str | bytes) -> str:
    return method.decode() if isinstance(method, bytes) else method


class _ClientAuth:
    def __init__(self, credentials: Credentials) -> None:
        self._credentials = credentials

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        pairs = self._credentials.call_metadata(_method_name(details.method))
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *pairs)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# grpc.aio files an interceptor under the first call kind it implements, so one class per kind.
class _UnaryUnaryAuth(_ClientAuth, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _UnaryStreamAuth(_ClientAuth, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _StreamUnaryAuth(_ClientAuth, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStreamAuth(_ClientAuth, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


def auth_interceptors(credentials: Credentials) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add `credentials`' metadata to every call of an aio channel."""
    return [
        _UnaryUnaryAuth(credentials),
        _UnaryStreamAuth(credentials),
        _StreamUnaryAuth(credentials),
        _StreamStreamAuth(credentials),
    ]


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    credentials = _process.credentials
    return auth_interceptors(credentials) if credentials is not None else []


class _SyncDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class SyncClientAuthInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """`ClientAuthInterceptor` for the blocking API (CLI commands, the SDK)."""

    def __init__(self, credentials: Credentials) -> None:
        self._credentials = credentials

    def _details(self, details: Any) -> _SyncDetails:
        metadata = [*(details.metadata or ()), *self._credentials.call_metadata(_method_name(details.method))]
        return _SyncDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return continuation(self._details(client_call_details), request_iterator)


def sync_channel(address: str, options: Any = None) -> grpc.Channel:
    """A blocking channel that carries this process's credential (when it has one)."""
    tls = transport.channel_credentials()
    channel = (
        grpc.insecure_channel(address, options=options)
        if tls is None
        else grpc.secure_channel(address, tls, options=options)
    )
    credentials = _process.credentials
    if credentials is None:
        return channel
    return grpc.intercept_channel(channel, SyncClientAuthInterceptor(credentials))
