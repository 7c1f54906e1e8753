"""Is the gateway ready to serve: it is not shutting down, its scheduler session is up and at
least one model is READY. Each report also names the generative models that are READY
(`ready_generative_models`), so a load balancer can route a model's requests to the gateways
that can answer them; `/readyz?model=<id>` answers 503 unless that model is READY."""

from __future__ import annotations

from dataclasses import dataclass

from loadmaster.common.backends import GENERATIVE_BACKENDS
from loadmaster.common.errors import LoadmasterError
from loadmaster.gateway.catalog import ModelCatalog
from loadmaster.gateway.scheduler_link import SchedulerLink

__all__ = ["Readiness", "ReadinessReport"]


@dataclass(frozen=True, slots=True)
class ReadinessReport:
    scheduler_connected: bool
    ready_models: tuple[str, ...] = ()
    reason: str = ""
    ready_generative_models: tuple[str, ...] = ()

    @property
    def ready(self) -> bool:
        return self.scheduler_connected and bool(self.ready_models)

    def as_dict(self) -> dict[str, object]:
        return {
            "ready": self.ready,
            "scheduler_connected": self.scheduler_connected,
            "ready_models": list(self.ready_models),
            "ready_generative_models": list(self.ready_generative_models),
            "reason": self.reason,
        }

    def serves(self, model: str) -> bool:
        return self.ready and model in self.ready_models


class Readiness:
    def __init__(self, scheduler: SchedulerLink, catalog: ModelCatalog) -> None:
        self._scheduler = scheduler
        self._catalog = catalog
        self.draining = False  # set once on SIGTERM: never ready again
        self.last: ReadinessReport | None = None  # the latest report, for probes that cannot wait

    async def check(self) -> ReadinessReport:
        self.last = report = await self._check()
        return report

    async def _check(self) -> ReadinessReport:
        if self.draining:
            return ReadinessReport(self._scheduler.connected, reason="the gateway is shutting down")
        if not self._scheduler.connected:
            return ReadinessReport(False, reason="the scheduler session is not connected")
        try:
            views = await self._catalog.models()
        except LoadmasterError as error:
            return ReadinessReport(False, reason=error.message)
        ready = tuple(name for name, view in views.items() if view.ready)
        generative = tuple(name for name in ready if views[name].backend in GENERATIVE_BACKENDS)
        return ReadinessReport(True, ready, "" if ready else "no model is READY", generative)
