"""The internal credential itself: who a process is (`Identity`) and the keys that prove it
(`Credentials`): HMAC-SHA256 over what a call or a data-port message says, checked by the
receiver. How a process gets and uses them is `loadmaster.common.internal_auth`."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass

from loadmaster.common.errors import PermissionDeniedError, UnauthenticatedError

__all__ = [
    "ADMIN_HEADER",
    "ADMIN_METHODS",
    "AUTH_HEADER",
    "DATA_PORT_SENDER",
    "ENVELOPE_KEY",
    "IDENTITY_HEADER",
    "IDENTITY_KEY_PREFIX",
    "SERVICE_METHODS",
    "SUITE_SERVICES",
    "Credentials",
    "Identity",
]

IDENTITY_HEADER = "x-loadmaster-identity"
AUTH_HEADER = "x-loadmaster-auth"
ADMIN_HEADER = "x-loadmaster-admin"
ENVELOPE_KEY = "loadmaster-auth"

# Calls that change what the fleet serves or owns: the admin credential is needed.
ADMIN_METHODS: frozenset[str] = frozenset(
    {
        "/loadmaster.v1.SchedulerService/SetStrategy",
        "/loadmaster.v1.ModelPoolService/Load",
        "/loadmaster.v1.ModelPoolService/Unload",
        "/loadmaster.v1.ModelPoolService/Pin",
        "/loadmaster.v1.GpuBrokerService/RegisterNode",
    }
)

# The suite's own services: identity keys are never issued for them, so a process outside the
# suite cannot pose as one; the calls only one of them makes are reserved to it.
SUITE_SERVICES = frozenset({"gateway", "scheduler", "model-pool", "gpu-broker", "metrics"})
SERVICE_METHODS: dict[str, str] = {
    "/loadmaster.v1.SchedulerService/WorkerSession": "model-pool",  # registering a worker
    "/loadmaster.v1.SchedulerService/Session": "gateway",  # receiving grants for client requests
}
DATA_PORT_SENDER = "gateway"

_NS = 1_000_000_000
_MAX_IDENTITY = 200
_REPLAY_CAP = 1_000_000  # remembered data-port MACs (≈150 B each with the dict entry); oldest go first


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


def _mac(key: bytes, *parts: str) -> str:
    return hmac.new(key, "\n".join(parts).encode(), hashlib.sha256).hexdigest()


IDENTITY_KEY_PREFIX = "lmid1:"  # an identity key: `lmid1:<service>/<instance>:<hex key>`


def _identity_key(master: bytes, identity_text: str) -> bytes:
    return hmac.digest(master, b"identity\n" + identity_text.encode(), "sha256")


def _same(given: str, expected: str) -> bool:
    """Constant-time comparison of a MAC a caller sent (any text: compared as UTF-8 bytes, so
    a non-ASCII value is a mismatch, not a TypeError) with the expected one."""
    return hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode())


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
        self._seen: dict[bytes, int] = {}  # data-port MAC (first 16 bytes) -> when it may be forgotten (ns)

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
        if not _same(mac, _mac(key, "grpc", claimed, method, stamp)):
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
        if not _same(mac, _mac(key, "data", claimed, request_id, stamp)):
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
        digest = bytes.fromhex(mac)[:16]  # verified hex; 16 bytes tell messages apart and keep it small
        if digest in seen:
            raise UnauthenticatedError("data-port message replayed")
        seen[digest] = int(stamp) + 2 * self._skew_ns
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
