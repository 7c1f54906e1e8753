"""The series every service reports, and how the metrics service exposes each one.

Reporters send `Sample(name, value, labels)`; the metrics service keeps every
sample in ring buffers and exposes each known name to Prometheus as
`loadmaster_<service>_<name>` (or `loadmaster_<name>{service=...}` for the series every
service reports) with the kind given here, in base units (`_ms` series become `_seconds`,
`_mb` ones `_bytes`), and the reporting replica as the `replica` label. Label values must
come from bounded sets: client ids, model ids, worker ids, GPU indexes, error *codes*
(never messages).

`service` names the service that reports a series; with `known`, the values a label can
take, it lets the metrics service create a counter at 0 as soon as a replica (or, for a
`model` label, a model) is first seen, so alerts see 0 rather than "no data". A label whose
values a client chooses (a tenant can be the request's `user`) names its bound in `capped`:
past that many values, the metrics service exposes the rest as `other`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

__all__ = ["EDGE_CODES", "METRICS", "MetricKind", "MetricSpec", "spec_for"]


class MetricKind(StrEnum):
    HISTOGRAM = "histogram"  # one sample per observation (latencies, sizes)
    COUNTER = "counter"  # one sample per event; value = increment
    GAUGE = "gauge"  # one sample per reading; the latest wins


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    kind: MetricKind
    help: str
    labels: tuple[str, ...] = ()
    service: str = ""  # the reporting service; "" = every service (exposed once, `service` label)
    known: tuple[tuple[str, tuple[str, ...]], ...] = ()  # label -> the values it can take
    capped: tuple[tuple[str, int], ...] = ()  # label -> how many values before `other`

    def known_values(self, label: str) -> tuple[str, ...] | None:
        return next((values for name, values in self.known if name == label), None)

    def cap(self, label: str) -> int | None:
        return next((bound for name, bound in self.capped if name == label), None)


# Edge error codes (`loadmaster.v1.ErrorCode` names, lower case), as the `code` labels carry them.
EDGE_CODES: tuple[str, ...] = (
    "invalid_argument",
    "not_found",
    "expired",
    "overflow",
    "superseded",
    "unavailable",
    "internal",
    "resource_exhausted",
    "cancelled",
    "unauthenticated",
    "permission_denied",
    "failed_precondition",
)
_CODE = (("code", EDGE_CODES),)
_TENANTS = (("tenant", 100),)  # a tenant may be a request's `user`: bounded for Prometheus
_RESULT = (("code", ("ok", *EDGE_CODES)),)


_H, _C, _G = MetricKind.HISTOGRAM, MetricKind.COUNTER, MetricKind.GAUGE


def _of(service: str, *specs: MetricSpec) -> tuple[MetricSpec, ...]:
    return tuple(replace(spec, service=service) for spec in specs)


_GATEWAY = _of(
    "gateway",
    MetricSpec("e2e_latency_ms", _H, "Time from receiving a request to sending its reply", ("model", "code")),
    MetricSpec(
        "observation_staleness_ms", _H, "Age of an observation when it reached the gateway", ("model",)
    ),
    MetricSpec("payload_size_bytes", _H, "Payload bytes per request", ("model",)),
    MetricSpec(
        "requests",
        _C,
        "Requests answered, by result code (ok or an error code)",
        ("model", "code"),
        known=_RESULT,
    ),
    MetricSpec(
        "observation_errors", _C, "Requests refused before queueing, by error code", ("code",), known=_CODE
    ),
    MetricSpec("send_errors", _C, "Replies that could not be sent to a client"),
    MetricSpec(
        "replies_dropped",
        _C,
        "Edge replies dropped for a peer over its byte budget",
        ("reason",),
        known=(("reason", ("byte_budget",)),),
    ),
    MetricSpec("identity_conflicts", _C, "Edge messages from a second key for a client id, dropped"),
    MetricSpec(
        "dispatch_errors",
        _C,
        "Failed sends to a worker's data port, by error code",
        ("model", "code"),
        known=_CODE,
    ),
    MetricSpec("dispatch_retries", _C, "Requests re-queued after a retryable failure", ("model",)),
    MetricSpec("shm_payloads", _C, "Request payloads handed to a local worker in shared memory", ("model",)),
    # generative models, as the client sees them
    MetricSpec("time_to_first_token_ms", _H, "Time from a generation request to its first token", ("model",)),
    MetricSpec("inter_token_latency_ms", _H, "Time between two streamed chunks of a generation", ("model",)),
)
_SCHEDULER = _of(
    "scheduler",
    MetricSpec("active_clients", _G, "Clients seen recently"),
    MetricSpec("client_disconnected", _C, "Clients marked disconnected"),
    MetricSpec("scheduling_wait_ms", _H, "Time a request waited in the scheduler's queue", ("model",)),
    MetricSpec("queue_depth", _G, "Requests waiting per model", ("model",)),
    MetricSpec("grants", _C, "Requests granted to a worker", ("model", "worker")),
    MetricSpec("requests_expired", _C, "Requests answered `expired`", ("model",)),
    MetricSpec("queue_full_drops", _C, "Requests answered `overflow`", ("model",)),
    MetricSpec("loads_commanded", _C, "Load commands sent to workers", ("model", "worker")),
    MetricSpec("vram_gate_waits", _C, "Loads refused for GPU memory whose requests wait for it", ("model",)),
    MetricSpec(
        "requests_dropped",
        _C,
        "Queued requests answered without running, by reason",
        ("model", "reason"),
        known=(("reason", ("overflow", "expired", "superseded", "client_disconnected")),),
    ),
    MetricSpec("request_retries", _C, "Granted requests queued again after a retryable failure", ("model",)),
    MetricSpec(
        "placement_decisions",
        _C,
        "Placement choices, by kind (grant, load, credit)",
        ("model", "worker", "kind"),
    ),
    MetricSpec("credits_lent", _C, "Worker slots lent to a gateway as dispatch credits", ("model",)),
    MetricSpec("credits_revoked", _C, "Dispatch credits revoked (a request had to wait)", ("model",)),
    MetricSpec("strategy_switches", _C, "Strategy changes through SetStrategy", ("strategy",)),
)
_MODEL_POOL = _of(
    "model-pool",
    MetricSpec("inference_latency_ms", _H, "Engine time per batch", ("model",)),
    MetricSpec("batch_size", _H, "Requests per engine call", ("model",)),
    MetricSpec("model_load_ms", _H, "Time to load and warm a model", ("model",)),
    MetricSpec(
        "evictions",
        _C,
        "Models unloaded to make room or when idle, by reason",
        ("model", "reason"),
        known=(("reason", ("capacity", "idle", "lease_lost")),),
    ),
    MetricSpec("slot_state", _G, "Model slot state (1 = in this state)", ("model", "state")),
    MetricSpec("reloads", _C, "Loads of a model this worker had evicted before", ("model",)),
    MetricSpec(
        "leases_reestablished",
        _C,
        "GPU leases the broker lost and granted again to a loaded model",
        ("model",),
    ),
    MetricSpec("worker_leased_mb", _G, "GPU memory a worker holds under its leases", ("gpu",)),
    # generative models, in the engine
    MetricSpec("prompt_tokens", _C, "Prompt tokens of the generations run", ("model",)),
    MetricSpec("output_tokens", _C, "Tokens generated", ("model",)),
    MetricSpec("sequences_running", _G, "Sequences being generated", ("model",)),
    MetricSpec("sequences_waiting", _G, "Sequences waiting in the engine for a slot", ("model",)),
    MetricSpec("preemptions", _C, "Sequences paused for a more urgent one", ("model",)),
    MetricSpec(
        "yields",
        _C,
        "Sequences that gave their place at a timeslice to waiting work of a better class",
        ("model",),
    ),
    MetricSpec("resumptions", _C, "Paused sequences resumed", ("model",)),
    MetricSpec(
        "kv_kept", _C, "Pauses that kept the KV cache until the sequence resumed or ended", ("model",)
    ),
    MetricSpec(
        "kv_recomputed", _C, "Paused sequences whose KV cache was freed (they prefill again)", ("model",)
    ),
    MetricSpec(
        "generation_queue_wait_ms",
        _H,
        "Time from a generation's arrival at the worker to its first token, by priority",
        ("model", "priority"),
    ),
    MetricSpec(
        "tenant_prompt_tokens",
        _C,
        "Prompt tokens of the generations run, by tenant",
        ("model", "tenant"),
        capped=_TENANTS,
    ),
    MetricSpec(
        "tenant_output_tokens",
        _C,
        "Tokens generated, by tenant",
        ("model", "tenant"),
        capped=_TENANTS,
    ),
    MetricSpec(
        "tenant_counter_gap",
        _G,
        "Largest gap between backlogged tenants' virtual token counters",
        ("model",),
    ),
    MetricSpec("kv_cache_blocks_used", _G, "KV-cache blocks in use", ("model",)),
    MetricSpec("kv_cache_blocks_total", _G, "KV-cache blocks the engine holds", ("model",)),
    # prefix reuse (docs/prefix-reuse.md); unlike vLLM's, queries and hits count requests
    MetricSpec("prefix_cache_queries", _C, "Prompts matched against the prefix cache", ("model",)),
    MetricSpec("prefix_cache_hits", _C, "Prompts that reused cached KV pages of a prefix", ("model",)),
    MetricSpec(
        "prefix_cache_reused_tokens", _C, "Prompt tokens whose KV came from the prefix cache", ("model",)
    ),
    MetricSpec("prefix_cache_evicted_blocks", _C, "Cached prefix KV pages evicted", ("model",)),
    MetricSpec("prefix_cache_blocks", _G, "KV pages held only for prefix reuse", ("model",)),
)
_GPU_BROKER = _of(
    "gpu-broker",
    MetricSpec("lease_mb", _G, "GPU memory under live leases", ("node", "gpu")),
    MetricSpec("free_mb", _G, "GPU memory free for leases", ("node", "gpu")),
    MetricSpec("outside_mb", _G, "GPU memory in use outside any lease (NVML)", ("node", "gpu")),
    MetricSpec("waiters", _G, "Acquire requests waiting for memory"),
    MetricSpec("grant_latency_ms", _H, "Time to grant an Acquire"),
    MetricSpec("lease_expirations", _C, "Leases reclaimed after their TTL passed"),
    MetricSpec("fencing_rejections", _C, "Renew/Release refused for a stale token"),
)
# Reported by every service's TelemetryReporter about its own process.
_EVERY_SERVICE = (
    MetricSpec(
        "build_info", _G, "1, labelled with the version of the reporting service", ("version", "python")
    ),
    MetricSpec("process_cpu_seconds", _C, "CPU time (user + system) of the reporting process"),
    MetricSpec("process_resident_memory_bytes", _G, "Resident memory of the reporting process"),
    MetricSpec("process_open_fds", _G, "Open file descriptors of the reporting process"),
    MetricSpec("process_start_time_seconds", _G, "Start time of the reporting process (UNIX seconds)"),
    MetricSpec(
        "event_loop_lag_ms", _H, "Longest delay of the process's event loop in each second (a late timer)"
    ),
)

METRICS: dict[str, MetricSpec] = {
    spec.name: spec for spec in (*_GATEWAY, *_SCHEDULER, *_MODEL_POOL, *_GPU_BROKER, *_EVERY_SERVICE)
}


def spec_for(name: str) -> MetricSpec | None:
    return METRICS.get(name)
