"""Internal credentials: every gRPC call between services and every data-port message
carries one, and the receiver knows who sent it (docs/security.md has the design).

A process has an `Identity` (service name + instance id) and holds the suite secret. It
proves the identity with an HMAC-SHA256 under that secret:

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

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from loadmaster.common.config import InternalAuthSettings, Settings
from loadmaster.common.errors import (
    ERROR_CODE_TRAILER,
    LoadmasterError,
    PermissionDeniedError,
    UnauthenticatedError,
)

__all__ = [
    "ADMIN_HEADER",
    "ADMIN_METHODS",
    "AUTH_HEADER",
    "DATA_PORT_SENDER",
    "ENVELOPE_KEY",
    "IDENTITY_HEADER",
    "IDENTITY_KEY_PREFIX",
    "RUN_DIR",
    "SERVICE_METHODS",
    "SUITE_SERVICES",
    "Credentials",
    "Identity",
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

IDENTITY_HEADER = "x-loadmaster-identity"
AUTH_HEADER = "x-loadmaster-auth"
ADMIN_HEADER = "x-loadmaster-admin"
ENVELOPE_KEY = "loadmaster-auth"
_PROTECTED_PREFIX = "/loadmaster.v1."  # the public KServe API (package `inference`) keeps API keys

# Calls that change what the fleet serves or owns: the admin credential is needed.
ADMIN_METHODS: frozenset[str] = frozenset(
    {
        "/loadmaster.v1.Scheduler/SetStrategy",
        "/loadmaster.v1.ModelPool/Load",
        "/loadmaster.v1.ModelPool/Unload",
        "/loadmaster.v1.ModelPool/Pin",
        "/loadmaster.v1.GpuBroker/RegisterNode",
    }
)

# The suite's own services: identity keys are never issued for them, so a process outside the
# suite cannot pose as one; the calls only one of them makes are reserved to it.
SUITE_SERVICES = frozenset({"gateway", "scheduler", "model-pool", "gpu-broker", "metrics"})
SERVICE_METHODS: dict[str, str] = {
    "/loadmaster.v1.Scheduler/WorkerSession": "model-pool",  # registering a worker
    "/loadmaster.v1.Scheduler/Session": "gateway",  # receiving grants for client requests
}
DATA_PORT_SENDER = "gateway"

_NS = 1_000_000_000
_MAX_IDENTITY = 200
_REPLAY_CAP = 1_000_000  # remembered data-port MACs (≈100 B each); the oldest go first past it


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a credential speaks for: `model-pool/host-1234`."""

    service: str
    instance: str

    def __str__(self) -> str:
        return f"{self.service}/{self.instance}"

    @classmethod
    def parse(cls, text: str) -> Identity:
        service, sep, instance = text.partition("/")
        if not sep or not service or not instance or len(text) > _MAX_IDENTITY:
            raise UnauthenticatedError(f"malformed identity {text[:_MAX_IDENTITY]!r}")
        return cls(service, instance)


class InsecureBindError(RuntimeError):
    """A port beyond loopback without internal auth, and `insecure: true` not set."""


def _mac(key: bytes, *parts: str) -> str:
    return hmac.new(key, "\n".join(parts).encode(), hashlib.sha256).hexdigest()


IDENTITY_KEY_PREFIX = "lmid1:"  # an identity key: `lmid1:<service>/<instance>:<hex key>`


def _identity_key(master: bytes, identity_text: str) -> bytes:
    return hmac.digest(master, b"identity\n" + identity_text.encode(), "sha256")


class Credentials:
    """One process's identity and its key: signs what it sends, verifies what it gets.

    Built from the suite secret, it can sign as any identity and verify everyone. Built from an
    identity key (`from_identity_key`, what `loadmaster keys internal` issues to a training job
    or a script), it can sign only as that identity and verifies nothing: every MAC is made with
    the sender's own key, HMAC(suite key, identity), which receivers derive from the secret."""

    def __init__(
        self,
        secret: bytes,
        identity: Identity,
        *,
        admin_token: str = "",
        admin_sha256: str = "",
        max_clock_skew_s: float = 30.0,
        now_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        if len(secret) < 16:
            raise ValueError("the internal secret must be at least 16 bytes")
        master = hashlib.sha256(b"loadmaster-internal-v1\n" + secret).digest()
        self._init(master, identity, _identity_key(master, str(identity)), admin_token, admin_sha256)
        self._skew_ns = int(max_clock_skew_s * _NS)
        self._now_ns = now_ns

    def _init(
        self, master: bytes | None, identity: Identity, key: bytes, admin_token: str, admin_sha256: str
    ) -> None:
        self.identity = identity
        self._identity_text = str(identity)
        self._master = master
        self._key = key
        self._keys: dict[str, bytes] = {}  # verified identities' keys (bounded)
        self._admin_token = admin_token
        if not admin_sha256 and admin_token:
            admin_sha256 = hashlib.sha256(admin_token.encode()).hexdigest()
        self._admin_digest = bytes.fromhex(admin_sha256) if admin_sha256 else b""
        self._seen: dict[str, int] = {}  # data-port MAC -> when it may be forgotten (ns)

    @classmethod
    def from_identity_key(
        cls,
        text: str,
        *,
        admin_token: str = "",
        max_clock_skew_s: float = 30.0,
        now_ns: Callable[[], int] = time.time_ns,
    ) -> Credentials:
        """Credentials that can only speak for the identity `text` (`lmid1:<identity>:<hex>`) names."""
        body = text.strip().removeprefix(IDENTITY_KEY_PREFIX)
        claimed, _, key_hex = body.rpartition(":")
        try:
            key = bytes.fromhex(key_hex)
        except ValueError:
            key = b""
        if not text.strip().startswith(IDENTITY_KEY_PREFIX) or len(key) != 32:
            raise ValueError("not an identity key (expected lmid1:<service>/<instance>:<64 hex digits>)")
        made = cls.__new__(cls)
        made._init(None, Identity.parse(claimed), key, admin_token, "")
        made._skew_ns = int(max_clock_skew_s * _NS)
        made._now_ns = now_ns
        return made

    @property
    def can_verify(self) -> bool:
        return self._master is not None

    def identity_key(self, identity: Identity) -> str:
        """The key that lets its holder speak for `identity`, and only for it (never a suite service)."""
        if identity.service in SUITE_SERVICES:
            raise ValueError(f"identity keys are for processes outside the suite, not {identity.service!r}")
        return f"{IDENTITY_KEY_PREFIX}{identity}:{_identity_key(self._require_master(), str(identity)).hex()}"

    def with_identity(self, identity: Identity) -> Credentials:
        """The same secrets speaking for another identity (a process with several roles, tests)."""
        master = self._require_master()
        other = Credentials.__new__(Credentials)
        other._init(master, identity, _identity_key(master, str(identity)), self._admin_token, "")
        other._admin_digest = self._admin_digest
        other._skew_ns, other._now_ns = self._skew_ns, self._now_ns
        return other

    def _require_master(self) -> bytes:
        if self._master is None:
            raise RuntimeError(f"{self.identity} holds an identity key, not the suite secret")
        return self._master

    def _key_of(self, claimed: str) -> bytes:
        key = self._keys.get(claimed)
        if key is None:
            key = _identity_key(self._require_master(), claimed)
        return key

    def _remember(self, claimed: str, key: bytes) -> None:
        if len(self._keys) < 1024:  # only verified identities are remembered
            self._keys[claimed] = key

    # ---- gRPC ----------------------------------------------------------------

    def call_metadata(self, method: str) -> list[tuple[str, str]]:
        now = str(self._now_ns())
        pairs = [
            (IDENTITY_HEADER, self._identity_text),
            (AUTH_HEADER, f"{now}.{_mac(self._key, 'grpc', self._identity_text, method, now)}"),
        ]
        if self._admin_token and method in ADMIN_METHODS:
            pairs.append((ADMIN_HEADER, self._admin_token))
        return pairs

    def verify_call(self, metadata: Mapping[str, str], method: str) -> Identity:
        """The caller's identity; `UnauthenticatedError` / `PermissionDeniedError` otherwise."""
        claimed = metadata.get(IDENTITY_HEADER, "")
        token = metadata.get(AUTH_HEADER, "")
        if not claimed or not token:
            raise UnauthenticatedError("no internal credential")
        identity = Identity.parse(claimed)
        stamp, _, mac = token.partition(".")
        self._check_time(stamp)
        key = self._key_of(claimed)
        if not hmac.compare_digest(mac, _mac(key, "grpc", claimed, method, stamp)):
            raise UnauthenticatedError("internal credential does not verify")
        self._remember(claimed, key)
        if (only := SERVICE_METHODS.get(method)) is not None and identity.service != only:
            raise PermissionDeniedError(f"only {only} may call {method}, not {identity}")
        if method in ADMIN_METHODS and self._admin_digest and not self.admin_verified(metadata):
            raise PermissionDeniedError(f"{method} needs the admin credential")
        return identity

    def admin_verified(self, metadata: Mapping[str, str]) -> bool:
        """True when an admin token is configured and the call carries it (sent on every call of
        `ADMIN_METHODS`; elsewhere, e.g. an operator releasing another holder's lease, only when
        the caller adds `ADMIN_HEADER` itself)."""
        given = metadata.get(ADMIN_HEADER, "")
        digest = hashlib.sha256(given.encode()).digest()
        return bool(self._admin_digest and given and hmac.compare_digest(digest, self._admin_digest))

    # ---- data port -----------------------------------------------------------

    def sign_envelope(self, metadata: MutableMapping[str, str], request_id: str) -> None:
        now = str(self._now_ns())
        mac = _mac(self._key, "data", self._identity_text, request_id, now)
        metadata[ENVELOPE_KEY] = f"{self._identity_text} {now} {mac}"

    def verify_envelope(self, metadata: Mapping[str, str], request_id: str) -> Identity:
        """The sender's identity; `UnauthenticatedError` for a missing, forged, stale or replayed one."""
        token = metadata.get(ENVELOPE_KEY, "")
        if not token:
            raise UnauthenticatedError("no internal credential on the data-port message")
        claimed, _, rest = token.partition(" ")
        stamp, _, mac = rest.partition(" ")
        identity = Identity.parse(claimed)
        now = self._check_time(stamp)
        key = self._key_of(claimed)
        if not hmac.compare_digest(mac, _mac(key, "data", claimed, request_id, stamp)):
            raise UnauthenticatedError("data-port credential does not verify")
        self._remember(claimed, key)
        if identity.service != DATA_PORT_SENDER:
            raise UnauthenticatedError(f"only a {DATA_PORT_SENDER} sends on the data port, not {identity}")
        seen = self._seen
        while seen:  # forget MACs whose time window has passed (oldest first)
            first = next(iter(seen))
            if seen[first] > now and len(seen) < _REPLAY_CAP:
                break
            del seen[first]
        if mac in seen:
            raise UnauthenticatedError("data-port message replayed")
        seen[mac] = int(stamp) + 2 * self._skew_ns
        return identity

    def _check_time(self, stamp: str) -> int:
        now = self._now_ns()
        try:
            sent = int(stamp)
        except ValueError:
            raise UnauthenticatedError("malformed internal credential") from None
        if abs(now - sent) > self._skew_ns:
            raise UnauthenticatedError(
                "internal credential outside the clock-skew window (stale or replayed)"
            )
        return now


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


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name, a wildcard (*) or an interface name: beyond loopback


def _host_of(address: str) -> str | None:
    """The host of a gRPC address or a ZMQ endpoint; None for ipc://, inproc://, unix: (local)."""
    if address.startswith(("ipc://", "inproc://", "unix:", "unix-abstract:")):
        return None
    address = address.removeprefix("tcp://")
    host, _, _ = address.rpartition(":")
    return host


def check_listen(name: str, address: str) -> None:
    """Refuse a bind beyond loopback while this process has no internal auth (unless insecure)."""
    host = _host_of(address)
    if host is None or _is_loopback(host) or _process.credentials is not None or _process.insecure:
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


def caller(context: grpc.aio.ServicerContext) -> Identity | None:
    """The identity the call was made with (verified by `ServerAuthInterceptor` when auth is on)."""
    for key, value in context.invocation_metadata() or ():
        if key == IDENTITY_HEADER:
            try:
                return Identity.parse(str(value))
            except UnauthenticatedError:
                return None
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
        metadata = {str(k): str(v) for k, v in handler_call_details.invocation_metadata or ()}
        try:
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
    channel = grpc.insecure_channel(address, options=options)
    credentials = _process.credentials
    if credentials is None:
        return channel
    return grpc.intercept_channel(channel, SyncClientAuthInterceptor(credentials))
