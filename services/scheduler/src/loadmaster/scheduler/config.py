"""The core's configuration: global defaults plus per-model queue policy and per-client budgets,
resolved from `Settings` once per id (settings do not change while the service runs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from loadmaster.common.config import Settings
from loadmaster.common.ordering import BatchRule, DeadlineTerms, Ordering, make_ordering
from loadmaster.scheduler.domain import OverflowPolicy

__all__ = ["CoreConfig", "ModelPolicy", "StrategyFactory", "strategy_factory"]


@dataclass(frozen=True, slots=True)
class ModelPolicy:
    """Queue policy of one model."""

    max_queue_size: int
    request_ttl_ms: float
    overflow_policy: OverflowPolicy
    latest_only: bool = False
    vram_mb: int | None = None
    # The mechanisms default to the shipped settings, as CoreConfig's do.
    dispatch_credits: int = 64  # worker slots a sole gateway may borrow while the queue is empty
    lookahead: int = 1  # calls a gateway stages behind a busy slot's running one (LocalQueue.stage)


def _memo(fn: Callable[[str], object]) -> Callable[[str], object]:
    cache: dict[str, object] = {}

    def get(key: str) -> object:
        value = cache.get(key)
        if value is None:
            value = cache[key] = fn(key)
        return value

    return get


@dataclass(frozen=True, slots=True)
class CoreConfig:
    max_queue_size: int = 1000
    request_ttl_ms: float = 5000.0
    overflow_policy: OverflowPolicy = OverflowPolicy.DROP_OLDEST
    max_retries: int = 1
    max_inflight: Callable[[str], int] = lambda model_id: 2  # per worker, per model
    # Per-model overrides (None: the global values above for every model).
    model_policy: Callable[[str], ModelPolicy] | None = None
    latency_budget_ms: Callable[[str], float] = lambda client_id: 50.0
    # What `latency_budget_ms` answers, as data a gateway's local queue can be sent: the
    # default budget and the clients configured otherwise.
    default_latency_budget_ms: float = 50.0
    client_latency_budgets_ms: dict[str, float] = field(default_factory=dict)
    cadence_alpha: float = 0.3
    disconnect_timeout_s: float = 10.0
    # The mechanism defaults are the shipped settings' (`SchedulerSettings`): a bare
    # CoreConfig schedules as a deployed scheduler does. Tests that need one off say so.
    # Dispatch credits (see credits.py); 0 = off.
    dispatch_credits: int = 64
    credit_window_s: float = 1.0
    share_period_s: float = 0.5  # how often shares split between gateways are measured again
    lookahead: int = 1  # see ModelPolicy
    # The VRAM gate (loads.py): a load refused for want of GPU memory is commanded again this
    # often while requests wait for the model (sooner when a worker frees memory).
    vram_gate_retry_ms: float = 1000.0
    _policies: dict[str, ModelPolicy] = field(default_factory=dict, compare=False, repr=False)

    def policy(self, model_id: str) -> ModelPolicy:
        policy = self._policies.get(model_id)
        if policy is None:
            if self.model_policy is not None:
                policy = self.model_policy(model_id)
            else:
                policy = ModelPolicy(
                    self.max_queue_size,
                    self.request_ttl_ms,
                    self.overflow_policy,
                    dispatch_credits=self.dispatch_credits,
                    lookahead=self.lookahead,
                )
            self._policies[model_id] = policy
        return policy

    @classmethod
    def from_settings(cls, settings: Settings) -> CoreConfig:
        s = settings.scheduler
        models = settings.models

        def model_policy(model_id: str) -> ModelPolicy:
            m = models.for_model(model_id)
            return ModelPolicy(
                max_queue_size=m.max_queue_size or s.max_queue_size,
                request_ttl_ms=m.request_ttl_ms or s.request_ttl_ms,
                overflow_policy=OverflowPolicy(m.overflow_policy or s.overflow_policy),
                latest_only=m.latest_only,
                vram_mb=m.vram_mb,
                dispatch_credits=s.dispatch_credits if m.dispatch_credits is None else m.dispatch_credits,
                lookahead=s.lookahead if m.lookahead is None else m.lookahead,
            )

        max_inflight = _memo(lambda model_id: models.for_model(model_id).max_inflight)
        budgets = _memo(lambda client_id: settings.clients.for_client(client_id).latency_budget_ms)
        return cls(
            max_queue_size=s.max_queue_size,
            request_ttl_ms=s.request_ttl_ms,
            overflow_policy=OverflowPolicy(s.overflow_policy),
            max_retries=s.max_retries,
            max_inflight=max_inflight,  # type: ignore[arg-type]
            model_policy=model_policy,
            latency_budget_ms=budgets,  # type: ignore[arg-type]
            default_latency_budget_ms=settings.clients.defaults.latency_budget_ms,
            client_latency_budgets_ms={
                client_id: settings.clients.for_client(client_id).latency_budget_ms
                for client_id in settings.clients.known
            },
            cadence_alpha=settings.response_tracking.cadence_alpha,
            disconnect_timeout_s=settings.response_tracking.disconnect_timeout_s,
            dispatch_credits=s.dispatch_credits,
            credit_window_s=s.credit_window_s,
            share_period_s=s.share_period_s,
            lookahead=s.lookahead,
            vram_gate_retry_ms=s.vram_gate_retry_ms,
        )


StrategyFactory = Callable[[str, str | None], Ordering]


def strategy_factory(settings: Settings) -> StrategyFactory:
    """`(name, policy) -> Ordering` with the strategy parameters of `settings.scheduler`."""
    s = settings.scheduler
    d = s.deadline
    terms = DeadlineTerms(
        priority_step_ms=d.priority_step_ms,
        urgency_weight=d.urgency_weight,
        steps_horizon=d.steps_horizon,
        service_ms=d.service_ms,
    )
    batch = BatchRule(max_batch_size=s.batch.max_batch_size, max_wait_s=s.batch.max_wait_ms / 1000.0)

    def make(name: str, policy: str | None) -> Ordering:
        return make_ordering(name, policy=policy, terms=terms, tiers=list(s.tiers), batch=batch)

    return make
