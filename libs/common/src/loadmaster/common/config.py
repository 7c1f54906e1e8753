"""The one typed configuration object.

`load_settings(path)` reads `loadmaster.yaml` (pydantic-settings' own YAML source) and applies
environment overrides: `LOADMASTER_<SECTION>__<FIELD>` (e.g.
`LOADMASTER_SCHEDULER__REQUEST_TTL_MS=200`), and `REDIS_URL`. Services build it once in `main`
and pass it down; nothing else reads `os.environ`. Units are in the names (`_ms`, `_s`, `_mb`,
`_bytes`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from loadmaster.common.client_config import ClientProfileSettings, CooldownSettings, check_profiles
from loadmaster.common.errors import InvalidArgumentError
from loadmaster.common.gateway_config import GatewaySettings
from loadmaster.common.redis_url import is_sentinel_url, parse_sentinel_url
from loadmaster.common.settings_section import Section as _Section
from loadmaster.common.settings_section import ServiceEndpoint

__all__ = [
    "AliasSettings",
    "BatchSettings",
    "CategoryKeepAliveSettings",
    "ClientSettings",
    "ClientsSettings",
    "ConfigError",
    "DeadlineSettings",
    "GenerationSettings",
    "GpuBrokerSettings",
    "GpuSpec",
    "InternalAuthSettings",
    "LeaderLeaseSettings",
    "LeaseTiming",
    "MetricsSettings",
    "ModelPoolSettings",
    "ModelSettings",
    "ModelsSettings",
    "RedisSettings",
    "ResponseTrackingSettings",
    "SchedulerSettings",
    "Settings",
    "TenantSettings",
    "load_settings",
]


class ConfigError(InvalidArgumentError, ValueError):
    """The configuration cannot be used: the file is missing or not YAML, or a key is unknown or
    holds a bad value. The message names the file and each key (`scheduler.max_queue_size`)."""


class DeadlineSettings(_Section):
    """Terms of the deadline family's virtual deadline (see loadmaster.common.ordering.deadline).

    virtual deadline = enqueued + min(budget, max(cadence, service_ms)) x urgency factor x steps factor
                       + priority x priority_step_ms + queued-by-the-same-client x service_ms
    """

    # Aging bound: a priority-p request is served before any request of priority 0 that
    # arrived more than p x priority_step_ms (plus the budget difference) after it.
    priority_step_ms: float = Field(default=100.0, ge=0)
    urgency_weight: float = Field(default=0.5, ge=0, lt=1)  # urgency 1 cuts the slack by this share
    steps_horizon: int = Field(default=8, ge=1)  # steps_remaining at or above this: no extra urgency
    service_ms: float = Field(default=10.0, ge=0)  # spacing between one client's queued requests


class BatchSettings(_Section):
    max_batch_size: int = Field(default=8, ge=1)
    max_wait_ms: float = Field(default=5.0, ge=0)


class LeaderLeaseSettings(_Section):
    """Scheduler failover (docs/deploy.md, "Scheduler failover"): with `enabled`, a scheduler
    serves only while it holds the leader lease in Redis (`redis_url`); a standby waits, polling
    every `poll_interval_ms`, and takes over once the leader's lease lapses (`ttl_ms` after its
    last renewal, at worst). Clients list every scheduler in `scheduler.address` as one gRPC
    target (`ipv4:10.0.0.1:50051,10.0.0.2:50051`); each scheduler binds its own `listen`."""

    enabled: bool = False
    ttl_ms: int = Field(default=2000, ge=100)
    renew_interval_ms: int = Field(default=500, gt=0)
    poll_interval_ms: int = Field(default=250, gt=0)
    key_prefix: str = "loadmaster:scheduler"

    @model_validator(mode="after")
    def _renew_well_within_ttl(self) -> LeaderLeaseSettings:
        if self.renew_interval_ms * 2 > self.ttl_ms:
            raise ValueError("renew_interval_ms: at most half of ttl_ms (one lost renewal must not end it)")
        return self


class SchedulerSettings(ServiceEndpoint):
    address: str = "127.0.0.1:50051"
    # model_deadline | deadline_aware | tiered_deadline | batch_optimized | priority_tiered | round_robin
    strategy: str = "model_deadline"
    policy: str | None = None  # a @register_policy name, for the deadline family
    policy_modules: list[str] = Field(default_factory=list)  # imported at start to register policies
    tiers: list[int] = Field(default_factory=lambda: [0, 1, 2])  # tiered_deadline: highest priority per tier
    deadline: DeadlineSettings = DeadlineSettings()
    batch: BatchSettings = BatchSettings()
    max_queue_size: int = Field(default=1000, ge=1)
    request_ttl_ms: float = Field(default=5000.0, gt=0)
    overflow_policy: Literal["drop_oldest", "reject_newest"] = "drop_oldest"
    max_retries: int = Field(default=1, ge=0)
    # Dispatch credits (scheduler.proto, docs/data-path.md): while a model's queue is empty, lend
    # every free worker slot of it to the gateways that use it, so their requests skip the
    # scheduler round trip and each gateway queues its own waiting requests (same strategy);
    # several gateways split the slots. A model with more slots than this is not lent: every
    # request is granted here (so is one under batch_optimized, or latest_only). 0 = none is lent.
    dispatch_credits: int = Field(default=64, ge=0)
    # A gateway that used a model within this window is one of its borrowers.
    credit_window_s: float = Field(default=1.0, ge=0)
    # A model several gateways use is split between them in proportion to their demand, measured
    # again this often (docs/data-path.md "Shares between gateways").
    share_period_s: float = Field(default=0.5, gt=0)
    # Staged calls (docs/data-path.md): a gateway queueing a model's calls itself sends up to
    # this many to a busy slot's worker behind the one running, so the next call is there when
    # the running one ends instead of a round trip later; a waiting call more urgent than a
    # staged one then goes ahead of it. 0 = a slot gets its next call only after its reply.
    lookahead: int = Field(default=1, ge=0)
    # VRAM gate (docs/vram-gate.md): requests for a model whose load found no GPU memory wait
    # in the queue; the load is tried again this often (and whenever a worker frees memory).
    vram_gate_retry_ms: float = Field(default=1000.0, gt=0)
    leader_lease: LeaderLeaseSettings = LeaderLeaseSettings()  # failover to a standby scheduler


class ModelPoolSettings(ServiceEndpoint):
    address: str = "127.0.0.1:50052"
    data_bind: str = "tcp://127.0.0.1:5556"
    # How other processes reach the data port (the bind address may be 0.0.0.0 or a wildcard port).
    data_endpoint: str | None = None
    # Gateways on this host also reach the data port over a Unix socket, ~80 us quicker a call
    # than ZMQ (loadmaster.common.local_link; off with CurveZMQ, which it cannot carry).
    local_link: bool = True
    worker_id: str = ""  # default: <hostname>-<pid>
    node: str = "local"
    device: str = "cpu"
    preload: list[str] = Field(default_factory=list)
    lease_ttl_s: float = Field(default=15.0, gt=0)
    inference_threads: int = Field(default=4, ge=1)
    # Threads that decode JPEG/PNG tensors on this worker (libjpeg-turbo and zlib release the GIL).
    image_decode_threads: int = Field(default=2, ge=1)
    # A load that needs room waits this long for busy or recently loaded models to become evictable.
    eviction_wait_s: float = Field(default=10.0, ge=0)
    # The warm bump (docs/vram-gate.md): a load that needs the memory of a model of its own
    # priority that is in use (a request in flight, or one finished less than warm_bump_idle_ms
    # ago) waits for it up to warm_bump_max_ms, then drains and evicts it. 0 = no bump.
    warm_bump_max_ms: float = Field(default=2000.0, ge=0)
    warm_bump_idle_ms: float = Field(default=250.0, ge=0)
    # A model too big for one GPU may be leased across several GPUs of the node (one atomic lease).
    allow_split: bool = True


class GpuSpec(_Section):
    index: int = Field(ge=0)
    total_mb: int = Field(gt=0)
    name: str = "declared"
    uuid: str = ""


class GpuBrokerSettings(ServiceEndpoint):
    address: str = "127.0.0.1:50053"
    node: str = "local"  # the node whose GPUs NVML finds, when it finds any
    lease_ttl_s: float = Field(default=30.0, gt=0)
    reserve_mb: int = Field(default=512, ge=0)
    key_prefix: str = "loadmaster:gpu"
    # Inventory used when NVML finds no NVIDIA GPU, per node.
    declared: dict[str, list[GpuSpec]] = Field(
        default_factory=lambda: {"local": [GpuSpec(index=0, total_mb=16_384)]}
    )
    use_nvml: bool = True
    # Answer Acquire/Renew/Release/Register only once a Redis replica holds their writes
    # (`WAIT 1 <ms>`; UNAVAILABLE when none acknowledges in time), so a grant survives a
    # failover. 0 = off; unset = 200 ms with a redis+sentinel:// URL, else off.
    replica_ack_timeout_ms: int | None = Field(default=None, ge=0)


class MetricsSettings(ServiceEndpoint):
    address: str = "127.0.0.1:50054"
    http_host: str = "127.0.0.1"
    http_port: int = 8002
    ring_size: int = Field(default=10_000, ge=100)
    report_interval_ms: float = Field(default=250.0, gt=0)
    # How often each service's event-loop probe wakes (`event_loop_lag_ms`): a stall shorter than
    # this may read low by up to this much. Every tick wakes an idle process; 10 ms cost each
    # service ~100 wake-ups/s and the idle suite ~4 % of a core (bench/idle_probe.py).
    loop_lag_tick_ms: float = Field(default=100.0, gt=0)
    enabled: bool = True
    # Prometheus series of a replica (a reporting process) that reported nothing for this long
    # are removed; every reporter sends its process metrics every few seconds.
    replica_ttl_s: float = Field(default=300.0, gt=0)


class ModelSettings(_Section):
    """Deployment settings of one model (its definition lives in the model repository)."""

    max_inflight: int = Field(default=2, ge=1)
    vram_mb: int | None = Field(default=None, ge=0)
    pin: bool = False
    priority: int = Field(default=1, ge=0)
    keep_alive_s: float | None = Field(default=None, gt=0)
    # Scheduler queue policy for this model; None = the scheduler's global setting.
    latest_only: bool = False  # a client's newer request supersedes its queued older one
    max_queue_size: int | None = Field(default=None, ge=1)
    request_ttl_ms: float | None = Field(default=None, gt=0)
    overflow_policy: Literal["drop_oldest", "reject_newest"] | None = None
    dispatch_credits: int | None = Field(default=None, ge=0)
    lookahead: int | None = Field(default=None, ge=0)
    # Anti-thrash: a model loaded less than this long ago is not evicted to make room.
    min_resident_s: float = Field(default=1.0, ge=0)
    # Overrides of the model's config.yaml (None = what config.yaml says).
    max_batch_size: int | None = Field(default=None, ge=1)
    max_queue_delay_ms: float | None = Field(default=None, ge=0)
    preferred_batch_sizes: list[int] | None = None
    instances: int | None = Field(default=None, ge=1)


class CategoryKeepAliveSettings(_Section):
    """Idle seconds before a model is unloaded, per category, for models whose `keep_alive_s` is
    set neither in `models.known` nor in their config.yaml (docs/ladders.md); None = never."""

    llm: float | None = Field(default=300.0, gt=0)
    vision: float | None = Field(default=60.0, gt=0)
    diffusion: float | None = Field(default=900.0, gt=0)
    other: float | None = Field(default=None, gt=0)


class AliasSettings(_Section):
    """A model ladder: a name for an ordered list of models, the primary first, then fallbacks.
    A request for the alias goes to the primary when READY, else to the first READY fallback
    (unless `pin_primary`), else to the primary (a cold load). A bare list is the `models`."""

    models: list[str] = Field(min_length=1)
    pin_primary: bool = False

    @model_validator(mode="before")
    @classmethod
    def _bare_list(cls, value: Any) -> Any:
        return {"models": value} if isinstance(value, list) else value

    @field_validator("models")
    @classmethod
    def _unique(cls, models: list[str]) -> list[str]:
        repeated = sorted({name for name in models if models.count(name) > 1})
        if repeated:
            raise ValueError(f"a model appears twice in the ladder: {', '.join(repeated)}")
        return models


class ModelsSettings(_Section):
    repository: Path = Path("models")
    defaults: ModelSettings = ModelSettings()
    known: dict[str, ModelSettings] = Field(default_factory=dict)
    # Names for model ladders (OpenAI API): {alias: {models: [primary, fallback, ...]}}.
    aliases: dict[str, AliasSettings] = Field(default_factory=dict)
    category_keep_alive_s: CategoryKeepAliveSettings = CategoryKeepAliveSettings()
    # A ladder may fall back to a hosted (remote) model only while this is true; a remote
    # primary, or a request naming a remote model, is always served (docs/ladders.md).
    allow_cloud_fallback: bool = True

    def for_model(self, model_id: str) -> ModelSettings:
        entry = self.known.get(model_id)
        if entry is None:
            return self.defaults
        return self.defaults.model_copy(update=entry.model_dump(exclude_unset=True))


class ClientSettings(_Section):
    latency_budget_ms: float = Field(default=50.0, gt=0)


class ClientsSettings(_Section):
    defaults: ClientSettings = ClientSettings()
    known: dict[str, ClientSettings] = Field(default_factory=dict)
    # Per-client defaults for generation requests, by name (docs/client-profiles.md).
    profiles: dict[str, ClientProfileSettings] = Field(default_factory=dict)
    # Every client's bound on requests per window (a profile's `cooldown` replaces it).
    cooldown: CooldownSettings = CooldownSettings()
    max_tracked_clients: int = Field(default=100_000, ge=1)  # cooldown states kept (least recent go)

    @field_validator("profiles")
    @classmethod
    def _one_profile_per_match(
        cls, profiles: dict[str, ClientProfileSettings]
    ) -> dict[str, ClientProfileSettings]:
        check_profiles(profiles)
        return profiles

    def for_client(self, client_id: str) -> ClientSettings:
        entry = self.known.get(client_id)
        if entry is None:
            return self.defaults
        return self.defaults.model_copy(update=entry.model_dump(exclude_unset=True))


class TenantSettings(_Section):
    """One tenant's share of generative service (docs/generation-scheduling.md): within a
    priority class, backlogged tenants get service in proportion to their weights."""

    weight: float = Field(default=1.0, gt=0)


class GenerationSettings(_Section):
    """How the worker's queue orders generations (docs/generation-scheduling.md).

    Priority first (0 is the most urgent), then, within a priority, token fairness between
    tenants (a virtual token counter: prompt tokens x 1 + output tokens x 2, divided by the
    tenant's weight; the lowest backlogged counter goes next), then arrival."""

    # Token fairness between tenants within a priority class; false: arrival order.
    fairness: bool = True
    # A lower-priority sequence yields its place after this many tokens while higher-priority
    # work waits, and resumes later with nothing lost; 0 = off (it yields only to priority 0).
    timeslice_tokens: int = Field(default=0, ge=0)
    # A waiting generation rises one priority class after this long (bounds starvation).
    promote_after_s: float = Field(default=10.0, gt=0)


class RedisSettings(_Section):
    """The embedded redis-server of `loadmaster up` (used when no `redis_url` is given) keeps its
    data in `data_dir` (relative: to the config file's folder), so settings changed at run time
    survive a restart. `admin_key_prefix` names the keys of the admin plane (docs/admin.md)."""

    data_dir: Path = Path(".loadmaster/redis")
    admin_key_prefix: str = "loadmaster:admin"


class ResponseTrackingSettings(_Section):
    cadence_alpha: float = Field(default=0.3, gt=0, lt=1)
    disconnect_timeout_s: float = Field(default=10.0, gt=0)


class InternalAuthSettings(_Section):
    """Credentials between services (loadmaster.common.internal_auth, docs/security.md).

    The suite secret (`secret`, or the file `secret_file`, e.g. a Docker secret) signs every
    internal gRPC call and data-port message; `loadmaster up` makes one when none is set. Admin
    RPCs also need the admin token when one is configured: `admin_token(_file)` where calls are
    made (gateway, CLI), `admin_token_sha256` (or the token itself) where they are checked.
    Without a secret, services refuse to bind beyond loopback unless `insecure` is true."""

    secret: SecretStr | None = None
    secret_file: Path | None = None
    admin_token: SecretStr | None = None
    admin_token_file: Path | None = None
    admin_token_sha256: str = Field(default="", pattern=r"^([0-9a-f]{64})?$")
    insecure: bool = False
    max_clock_skew_s: float = Field(default=30.0, gt=0)
    # Encryption between hosts (loadmaster.common.transport): TLS on every gRPC server (cert and
    # key) and channel (the CA that signed the servers' certificates); CurveZMQ on data ports
    # with keys derived from the secret.
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    data_port_curve: bool = False


class _YamlFileSource(YamlConfigSettingsSource):
    """pydantic-settings' YAML source, below environment variables in precedence. A file that
    cannot be read or parsed, or whose top level is not a mapping, is a `ConfigError` naming it
    (the library itself skips a file that does not exist: a file named here must exist)."""

    def __init__(self, settings_cls: type[BaseSettings], yaml_file: Path | None) -> None:
        if yaml_file is not None:
            try:
                yaml_file.open("rb").close()
            except OSError as error:
                raise ConfigError(
                    f"{yaml_file}: cannot read the configuration file: {error.strerror}"
                ) from None
        super().__init__(settings_cls, yaml_file=yaml_file)

    def _read_file(self, file_path: Any) -> dict[str, Any]:
        try:
            loaded: Any = super()._read_file(file_path)
        except OSError as error:
            raise ConfigError(f"{file_path}: cannot read the configuration file: {error.strerror}") from None
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            problem = getattr(error, "problem", None) or str(error)
            raise ConfigError(f"{file_path}: not valid YAML{where}: {problem}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{file_path}: the top level must be a mapping")
        return loaded


class _RedisUrlSource(PydanticBaseSettingsSource):
    """The conventional `REDIS_URL` variable: above the YAML file, below `LOADMASTER_REDIS_URL`."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        url = os.environ.get("REDIS_URL")
        return {"redis_url": url} if url else {}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="LOADMASTER_", env_nested_delimiter="__", extra="forbid", frozen=False
    )

    log_level: str = "INFO"
    # One line per record: "logfmt" (key=value, quoted and escaped) or "json" (one object per line).
    log_format: Literal["logfmt", "json"] = "logfmt"
    redis_url: str | None = None  # also read from REDIS_URL (see _RedisUrlSource)
    redis: RedisSettings = RedisSettings()
    gateway: GatewaySettings = GatewaySettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    model_pool: ModelPoolSettings = ModelPoolSettings()
    gpu_broker: GpuBrokerSettings = GpuBrokerSettings()
    metrics: MetricsSettings = MetricsSettings()
    models: ModelsSettings = ModelsSettings()
    clients: ClientsSettings = ClientsSettings()
    response_tracking: ResponseTrackingSettings = ResponseTrackingSettings()
    internal_auth: InternalAuthSettings = InternalAuthSettings()
    # Tenants by name (API keys name theirs; docs/generation-scheduling.md): {name: {weight: 1}}.
    tenants: dict[str, TenantSettings] = Field(default_factory=dict)
    generation: GenerationSettings = GenerationSettings()
    # The YAML file to read (None: defaults and the environment only), given at construction:
    # `load_settings(path)` or `Settings(config_file=path)`; the CLI's `--config` names it.
    # Left out of dumps: a dump carries the file's values, so validating one again (runtime
    # overrides) never reads the file a second time.
    config_file: Path | None = Field(default=None, exclude=True)
    # The folder the YAML file was read from; relative paths in it resolve against this.
    config_dir: Path = Path(".")

    @field_validator("redis_url")
    @classmethod
    def _valid_sentinel_url(cls, value: str | None) -> str | None:
        if value is not None and is_sentinel_url(value):
            parse_sentinel_url(value)  # a malformed one fails here, naming the part
        return value

    @field_validator("log_level")
    @classmethod
    def _upper(cls, value: str) -> str:
        return value.upper()

    @model_validator(mode="after")
    def _aliases_name_models(self) -> Settings:
        """Every alias target is a model: in `models.known`, or a folder of the repository (when
        the repository is on this host); an alias is no model's name and no alias's target."""
        aliases = self.models.aliases
        if not aliases:
            return self
        repository = self.repository_path
        on_host = repository.is_dir()
        for alias, ladder in aliases.items():
            where = f"models.aliases.{alias}"
            if alias in self.models.known or (on_host and (repository / alias / "config.yaml").is_file()):
                raise ValueError(f"{where}: '{alias}' is already a model's name")
            for target in ladder.models:
                if target in aliases:
                    raise ValueError(f"{where}: '{target}' is an alias; a ladder lists models")
                if target in self.models.known:
                    continue
                if on_host and (repository / target / "config.yaml").is_file():
                    continue
                place = f"nor a folder of the repository {repository}"
                if not on_host:
                    place = f"and the repository {repository} is not on this host"
                raise ValueError(f"{where}: unknown model '{target}': not in models.known, {place}")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file comes with the call (`config_file=`), not from class state, so loading one
        # file never leaks into the next settings object.
        given = init_settings.init_kwargs if isinstance(init_settings, InitSettingsSource) else {}
        yaml_file = given.get("config_file")
        return (
            init_settings,
            env_settings,
            _RedisUrlSource(settings_cls),
            _YamlFileSource(settings_cls, Path(yaml_file) if yaml_file is not None else None),
        )

    @property
    def repository_path(self) -> Path:
        repo = self.models.repository
        return repo if repo.is_absolute() else (self.config_dir / repo).resolve()


def load_settings(path: str | Path | None = None, **overrides: Any) -> Settings:
    """Settings from `path` (YAML) under environment overrides, under explicit `overrides`.

    Raises `ConfigError` (one message naming the file and the keys) when the file cannot be
    read or parsed, or a key is unknown or invalid."""
    config_dir = Path.cwd()
    source = "the environment (no config file)"
    if path is not None:
        path = Path(path)
        source = str(path)
        config_dir = path.resolve().parent
        overrides["config_file"] = path
    overrides.setdefault("config_dir", config_dir)
    try:
        return Settings(**overrides)
    except ValidationError as error:
        raise ConfigError(_describe(error, source)) from None


def _describe(error: ValidationError, source: str) -> str:
    """`invalid configuration in loadmaster.yaml:` then a line per key, e.g.
    `scheduler.max_queue_size: Input should be ... (got 0)`; a key set through the
    environment names its variable."""
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "(top level)"
        variable = "LOADMASTER_" + "__".join(str(part) for part in item["loc"]).upper()
        if variable in os.environ:
            key += f" (${variable})"
        got = "" if item["type"] == "missing" else f" (got {item.get('input')!r})"
        if item["type"] == "extra_forbidden":
            got = " (unknown key)"
        if not item["loc"]:  # a check across sections: its message names the keys
            lines.append(f"  {item['msg'].removeprefix('Value error, ')}")
            continue
        lines.append(f"  {key}: {item['msg']}{got}")
    return f"invalid configuration in {source}:\n" + "\n".join(lines)


# ---- GPU lease timing: the one place the broker and every holder take it from ----------------
# (see docs/leases.md). Fractions of the lease's TTL, so a lease of any TTL keeps the contract.
_LEASE_RENEW_FRACTION = 0.2  # renew every TTL/5
_LEASE_MARGIN_FRACTION = 0.2  # the holder stops using a lease TTL/5 before its TTL ends
_LEASE_GRACE_FRACTION = 1 / 3  # the broker re-grants TTL/3 after the TTL ends ...
_LEASE_GRACE_MIN_S = 1.0  # ... and never less than 1 s after it (time to unload on lapse)


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    """The lease timing contract between the gpu-broker and a lease's holder.

    The holder counts from when it SENT the Acquire/Renew that the broker granted; the broker
    counts from when it got it, which is later. So with `holder_deadline_s < regrant_after_s`
    the holder has stopped using the memory before the broker may promise it to anyone else:

        holder:  renews every `renew_every_s`; uses the lease only until
                 sent + `holder_deadline_s` (= ttl - margin) unless a renewal succeeded
        broker:  re-grants the memory only after received + `regrant_after_s` (= ttl + grace):
                 the holder's lease client asks it to keep the lease that long
    """

    ttl_s: float
    renew_every_s: float
    margin_s: float
    grace_s: float

    @classmethod
    def for_ttl(cls, ttl_s: float) -> LeaseTiming:
        return cls(
            ttl_s=ttl_s,
            renew_every_s=ttl_s * _LEASE_RENEW_FRACTION,
            margin_s=ttl_s * _LEASE_MARGIN_FRACTION,
            grace_s=max(_LEASE_GRACE_MIN_S, ttl_s * _LEASE_GRACE_FRACTION),
        )

    @property
    def holder_deadline_s(self) -> float:
        """After sending a granted Acquire/Renew, how long the holder may use the lease."""
        return self.ttl_s - self.margin_s

    @property
    def regrant_after_s(self) -> float:
        """After receiving an Acquire/Renew, how long the broker keeps the memory promised."""
        return self.ttl_s + self.grace_s

    @property
    def renew_timeout_s(self) -> float:
        """One renewal attempt's deadline: it is over before the next one starts."""
        return self.renew_every_s

    @property
    def attempts_before_deadline(self) -> int:
        """Renewal attempts that start (and end) before the holder's deadline."""
        count = 0
        while (count + 1) * self.renew_every_s + self.renew_timeout_s <= self.holder_deadline_s + 1e-9:
            count += 1
        return count
