"""The gateway's settings sections: the edge, input limits, authentication (API keys, CURVE,
OIDC), guardrails, the audit log, shared memory and the image API. Sections of the one
configuration object (`loadmaster.common.config.Settings.gateway`); import them from here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from loadmaster.common.settings_section import Section as _Section
from loadmaster.common.settings_section import ServiceEndpoint

__all__ = [
    "ApiKeySettings",
    "AuditSettings",
    "AuthSettings",
    "CurveSettings",
    "EdgeSettings",
    "GatewaySettings",
    "Gr00tSettings",
    "GuardrailSettings",
    "ImagesSettings",
    "LimitsSettings",
    "OidcSettings",
    "PolicyWebhookSettings",
    "SharedMemorySettings",
]


class EdgeSettings(_Section):
    bind: str = "tcp://127.0.0.1:5555"
    recv_hwm: int = Field(default=10_000, ge=1)
    send_hwm: int = Field(default=10_000, ge=1)
    # Reply bytes one peer may have queued and unread; past it its replies are dropped and
    # counted (one reply always goes out when nothing is queued). send_hwm counts messages.
    # 16 MiB keeps a gateway under 2x the payload limit above idle with a non-reading client
    # (tests/e2e/faults/test_reply_budget.py: +89 MiB, of which ~70 MiB is not replies).
    max_queued_reply_bytes: int = Field(default=16 << 20, ge=1)
    # Request payload bytes one peer may have in the gateway (checked, queued or at a worker)
    # awaiting their replies; past it its requests are refused `overflow` (one request is always
    # taken when it has none in flight, so a single request up to the payload limit passes).
    max_inflight_request_bytes: int = Field(default=16 << 20, ge=1)
    # ZMTP heartbeats: a peer that answers no PING within the timeout is disconnected, so a
    # client that restarts with its own identity gets it back (no handover of live ones).
    heartbeat_ivl_ms: int = Field(default=1000, ge=0)  # 0 = off
    heartbeat_timeout_ms: int = Field(default=3000, ge=0)
    heartbeat_ttl_ms: int = Field(default=3000, ge=0)
    # Observations whose check costs more than a loop turn are checked on threads, each holding
    # its payload meanwhile; past this many at once the next is refused (`resource_exhausted`),
    # so a flood of costly messages cannot hold unbounded memory.
    max_offloop_checks: int = Field(default=4, ge=1)


class Gr00tSettings(_Section):
    """The GR00T front end (frontends/gr00t.py, docs/robot-clients.md): a ZeroMQ ROUTER at `bind`
    that serves GR00T's PolicyClient (REQ/REP, msgpack) with `model`; off while `model` is empty.
    GR00T's own default port is 5555, the edge's, so this one defaults to 5557."""

    bind: str = "tcp://127.0.0.1:5557"
    model: str = ""  # empty = off

    @property
    def enabled(self) -> bool:
        return bool(self.model)


class LimitsSettings(_Section):
    """What one request may carry; anything larger is answered `invalid_argument`."""

    max_envelope_bytes: int = Field(default=1 << 20, ge=1)
    max_payload_bytes: int = Field(default=64 << 20, ge=1)
    max_tensors: int = Field(default=64, ge=1)
    max_dims: int = Field(default=8, ge=1)
    max_metadata_bytes: int = Field(default=16 << 10, ge=0)
    # Elements of one BYTES tensor: bounds the per-element work of checking and decoding it.
    max_bytes_elements: int = Field(default=1 << 20, ge=0)
    # JPEG/PNG tensors (docs/robot-clients.md): pixels (H x W) of one image, checked by the
    # gateway against the claimed shape and by the worker against the image's own header;
    # progressive JPEG scans (each one a pass over the whole image); and the time one request's
    # images may take to decode on the worker (past it: `invalid_argument` naming the tensor).
    max_image_pixels: int = Field(default=40_000_000, ge=1)
    max_image_scans: int = Field(default=64, ge=1)
    max_image_decode_ms: float = Field(default=250.0, gt=0)
    # The JSON part of an HTTP request (all of it without binary data): parsing it holds the
    # interpreter, ~110 MB/s here, so this bounds what one JSON body can stall. Binary tensor
    # data after the JSON header counts against max_payload_bytes instead.
    max_json_bytes: int = Field(default=4 << 20, ge=1)
    # Requests one gRPC ModelStreamInfer stream may have in flight; the stream reads no further
    # message until one finishes.
    max_stream_inflight: int = Field(default=64, ge=1)
    # HTTP: a request's headers and body must arrive within these (408 or a closed connection).
    http_header_timeout_s: float = Field(default=10.0, gt=0)
    http_body_timeout_s: float = Field(default=30.0, gt=0)
    http_keep_alive_s: float = Field(default=5.0, gt=0)  # an idle keep-alive connection is closed


def _infer_only() -> list[Literal["infer", "admin"]]:
    return ["infer"]


class ApiKeySettings(_Section):
    """One API key, stored hashed: `sha256` is the hex SHA-256 of the key (`loadmaster keys api`)."""

    name: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    scopes: list[Literal["infer", "admin"]] = Field(default_factory=_infer_only)
    rate_per_s: float = Field(default=0.0, ge=0)  # token-bucket refill; 0 = unlimited
    burst: int = Field(default=0, ge=0)  # bucket size; 0 = max(1, rate_per_s)
    # Whose generations these are for token fairness (`tenants` at the top level gives weights);
    # empty: the key's name.
    tenant: str = ""
    # The key is refused from this time on (Unix seconds); None = never expires.
    expires_unix_s: float | None = Field(default=None, gt=0)


class CurveSettings(_Section):
    """CurveZMQ on the edge: the server key pair and the client public keys allowed (Z85 text)."""

    server_public_key: str = ""
    server_secret_key: str = ""
    allowed_client_keys: list[str] = Field(default_factory=list)  # empty = any client with the server key

    @property
    def enabled(self) -> bool:
        return bool(self.server_secret_key)


def _signature_algorithms() -> list[Literal["RS256", "ES256"]]:
    return ["RS256", "ES256"]


def _default_scope_map() -> dict[str, list[Literal["infer", "admin"]]]:
    return {"loadmaster:infer": ["infer"], "loadmaster:admin": ["admin"]}


class OidcSettings(_Section):
    """OIDC / JWT bearer tokens beside API keys (loadmaster.gateway.oidc; docs/security.md).

    Tokens are verified as RS256 or ES256 against the issuer's JWKS (`jwks_url`, else the
    `jwks_uri` of `<issuer>/.well-known/openid-configuration`); `iss`, `aud`, `exp` and `nbf`
    are checked. The values of `scopes_claim` (a space-separated string or a list; a dotted
    path such as `realm_access.roles` reaches into objects) map to Loadmaster scopes through
    `scope_map`. `rate_per_s`/`burst` is a token bucket per subject, as for API keys."""

    issuer: str = ""  # empty = OIDC off
    audience: list[str] = Field(default_factory=list)
    jwks_url: str = ""
    algorithms: list[Literal["RS256", "ES256"]] = Field(default_factory=_signature_algorithms)
    subject_claim: str = "sub"
    scopes_claim: str = "scope"
    scope_map: dict[str, list[Literal["infer", "admin"]]] = Field(default_factory=_default_scope_map)
    leeway_s: float = Field(default=30.0, ge=0)
    rate_per_s: float = Field(default=0.0, ge=0)  # per subject; 0 = unlimited
    burst: int = Field(default=0, ge=0)
    max_subjects: int = Field(default=100_000, ge=1)  # rate-limit buckets kept (least recent go)
    jwks_cache_s: float = Field(default=300.0, gt=0)  # keys older than this are refreshed
    jwks_refetch_interval_s: float = Field(default=30.0, ge=0)  # unknown kid: at most one fetch per
    jwks_timeout_s: float = Field(default=5.0, gt=0)

    @property
    def enabled(self) -> bool:
        return bool(self.issuer)

    @field_validator("audience", mode="before")
    @classmethod
    def _one_audience(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _audience_named(self) -> OidcSettings:
        if self.issuer and not self.audience:
            raise ValueError(
                "audience must name this service when issuer is set (else any token of the issuer is taken)"
            )
        return self


class AuthSettings(_Section):
    """API keys for HTTP (`Authorization: Bearer`) and gRPC (`authorization` metadata).

    `required`: whether calls need a key (or an OIDC token); None = exactly when `api_keys`
    lists keys here. Keys added at run time (docs/admin.md) never turn it on by themselves."""

    api_keys: list[ApiKeySettings] = Field(default_factory=list)
    required: bool | None = None
    curve: CurveSettings = CurveSettings()
    oidc: OidcSettings = OidcSettings()

    @property
    def keys_required(self) -> bool:
        return self.required if self.required is not None else bool(self.api_keys)


class PolicyWebhookSettings(_Section):
    """An HTTP POST of each generation's metadata that answers `{"allow": bool, "reason": str}`."""

    url: str = ""  # empty = no webhook
    timeout_ms: float = Field(default=500.0, gt=0)
    fail_open: bool = False  # on a timeout or a bad answer: allow (True) or refuse (False)


class GuardrailSettings(_Section):
    """Blocklists on prompts and completions of the OpenAI API, and the policy webhook
    (loadmaster.gateway.guardrails; docs/security.md). Words match whole words, ignoring case;
    patterns are Python regular expressions. A stream holds back `stream_holdback_chars` (at
    least the longest word) so that no part of a blocked match is sent before it is seen."""

    blocked_words: list[str] = Field(default_factory=list)
    blocked_patterns: list[str] = Field(default_factory=list)
    check_prompts: bool = True
    check_completions: bool = True
    stream_holdback_chars: int = Field(default=64, ge=0)
    webhook: PolicyWebhookSettings = PolicyWebhookSettings()

    @field_validator("blocked_patterns")
    @classmethod
    def _compiles(cls, patterns: list[str]) -> list[str]:
        for index, pattern in enumerate(patterns):
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(f"blocked_patterns[{index}] is not a regular expression: {error}") from None
        return patterns


class AuditSettings(_Section):
    """One JSON line per OpenAI API request (loadmaster.gateway.audit; docs/audit.md). Prompts
    and completions are written as SHA-256 hashes unless `debug_mode`; the file rotates at
    `max_file_bytes`, keeping `backup_count` old files."""

    enabled: bool = False
    path: Path = Path("audit/gateway-audit.jsonl")  # relative: to the config file's folder
    max_file_bytes: int = Field(default=100 << 20, ge=1024)
    backup_count: int = Field(default=10, ge=0)
    queue_size: int = Field(default=10_000, ge=1)  # records waiting for the writer; more are dropped
    debug_mode: bool = False


class SharedMemorySettings(_Section):
    """Request payloads of at least `min_payload_bytes` go to workers on this host (ipc:// or
    loopback data endpoints) through a shared memory region of `region_mb`, reserved on first
    use, instead of a second socket transfer (loadmaster.common.shm). A slot whose worker
    never answered is reused after `quarantine_s`; a full region sends payloads on the socket."""

    enabled: bool = True
    min_payload_bytes: int = Field(default=64 << 10, ge=1)
    region_mb: int = Field(default=64, ge=1)
    quarantine_s: float = Field(default=30.0, gt=0)


def _image_sizes() -> list[str]:
    return ["64x64", "128x128", "256x256", "512x512", "1024x1024"]


class ImagesSettings(_Section):
    """`POST /v1/images/generations` and its async jobs (docs/images.md). Jobs live in Redis
    (`redis_url`) under `job_key_prefix`; a finished job's result stays `job_ttl_s`. A gateway
    marks itself alive every `owner_ttl_s` / 3; another gateway re-runs the unfinished jobs of
    one whose mark lapsed (checked every `recover_interval_s`), at most `max_attempts` times."""

    sizes: list[str] = Field(default_factory=_image_sizes)  # WIDTHxHEIGHT accepted (the model may narrow)
    max_n: int = Field(default=4, ge=1, le=10)
    timeout_ms: float = Field(default=120_000.0, gt=0)  # a request's deadline unless x_deadline_ms
    job_ttl_s: float = Field(default=3600.0, gt=0)
    job_key_prefix: str = "loadmaster:jobs"
    owner_ttl_s: float = Field(default=10.0, gt=0)
    recover_interval_s: float = Field(default=5.0, gt=0)
    max_attempts: int = Field(default=3, ge=1)


class GatewaySettings(ServiceEndpoint):
    address: str = "127.0.0.1:8001"
    gateway_id: str = ""  # default: <hostname>-<pid>
    # The public gRPC address is served by a child process that relays each call to the gateway
    # (large messages through shared memory), so receiving a large message never holds the
    # event loop that serves the other front ends (docs/frontend-isolation.md). False: the
    # gateway serves it on its own loop (one hop less per call, no isolation).
    grpc_process: bool = True
    edge: EdgeSettings = EdgeSettings()
    gr00t: Gr00tSettings = Gr00tSettings()
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    limits: LimitsSettings = LimitsSettings()
    auth: AuthSettings = AuthSettings()
    # Gateway -> scheduler: enqueues and completes are batched on the stream while it is busy.
    max_stream_batch: int = Field(default=256, ge=1)
    shm: SharedMemorySettings = SharedMemorySettings()
    # Reports of dispatch-credit runs wait up to this long to share a stream message.
    report_delay_s: float = Field(default=0.02, ge=0)
    scheduler_connect_timeout_s: float = Field(default=1.0, gt=0)
    # A request sent to a worker is answered `expired` when no reply came by its deadline + this.
    reply_grace_s: float = Field(default=10.0, gt=0)
    # (Heartbeats on the data links to workers and the grace of a lost worker's calls are not
    # settings: loadmaster.common.liveness holds every link's probe timing, docs/liveness.md.)
    images: ImagesSettings = ImagesSettings()
    # OpenAI's `n` (choices from one prompt, sharing its prefill): at most this many.
    max_n: int = Field(default=8, ge=1, le=64)
    guardrails: GuardrailSettings = GuardrailSettings()
    audit: AuditSettings = AuditSettings()
    # Images in chat messages (docs/dialects.md): data URLs always; http(s) URLs only from
    # these hosts (exact names, or "*.example.com" for its subdomains), fetched with a
    # deadline and a size bound. Each image is at most image_max_bytes, encoded.
    image_url_allow: list[str] = Field(default_factory=list)
    image_fetch_timeout_s: float = Field(default=10.0, gt=0)
    image_max_bytes: int = Field(default=10 << 20, ge=1)
    max_images: int = Field(default=8, ge=0)  # per request
    # Browsers: origins allowed to call the HTTP port (CORS; "*" for any); empty = none.
    cors_origins: list[str] = Field(default_factory=list)
    # TLS on the HTTP port (PEM files; relative paths: to the config file's folder).
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None

    @model_validator(mode="after")
    def _tls_pair(self) -> GatewaySettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: give both or neither")
        return self
