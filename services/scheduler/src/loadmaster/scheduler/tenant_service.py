"""Token fairness across workers: what each tenant got from a model on the other workers.

Each worker orders its generations by its tenants' virtual token counters (the model pool's
generation_order.py). A tenant spread over two workers would get a full share on each; so
workers report the weighted service they gave each tenant (cumulative since the model loaded
there), and every worker that serves the model is told what each tenant got on the *other*
workers, which its counters add (docs/generation-scheduling.md). Pure bookkeeping: the hub
(sessions.py) moves the messages.

    exchange.report(worker, {model: {tenant: service}}) -> {other worker: {model: {tenant: elsewhere}}}
    exchange.forget(worker)                              -> the same, for the workers it served with
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["TenantServiceExchange"]

Service = dict[str, dict[str, float]]  # model -> tenant -> weighted service


class TenantServiceExchange:
    def __init__(self) -> None:
        self._by_worker: dict[str, Service] = {}

    def report(self, worker_id: str, service: Mapping[str, Mapping[str, float]]) -> dict[str, Service]:
        """Record `worker_id`'s service; the remote service each other worker serving one of
        those models should now use."""
        mine = self._by_worker.setdefault(worker_id, {})
        for model_id, tenants in service.items():
            mine[model_id] = dict(tenants)
        return self._updates(set(service), skip=worker_id)

    def forget(self, worker_id: str) -> dict[str, Service]:
        """The worker left: what the others got from it no longer counts."""
        gone = self._by_worker.pop(worker_id, {})
        return self._updates(set(gone), skip=worker_id)

    def elsewhere(self, worker_id: str, model_id: str) -> dict[str, float]:
        """Per tenant, the service `model_id` gave on every worker but `worker_id`."""
        total: dict[str, float] = {}
        for other, models in self._by_worker.items():
            if other == worker_id:
                continue
            for tenant, value in models.get(model_id, {}).items():
                total[tenant] = total.get(tenant, 0.0) + value
        return total

    def _updates(self, models: set[str], *, skip: str) -> dict[str, Service]:
        out: dict[str, Service] = {}
        for worker_id, served in self._by_worker.items():
            if worker_id == skip:
                continue
            for model_id in models & set(served):
                out.setdefault(worker_id, {})[model_id] = self.elsewhere(worker_id, model_id)
        return out
