"""Token fairness across workers: each worker learns what each tenant got on the others."""

from __future__ import annotations

from loadmaster.scheduler.tenant_service import TenantServiceExchange


def test_each_worker_serving_a_model_hears_what_the_others_gave_each_tenant() -> None:
    exchange = TenantServiceExchange()
    assert exchange.report("w1", {"chat": {"a": 100.0, "b": 10.0}}) == {}  # nobody else serves it
    updates = exchange.report("w2", {"chat": {"a": 50.0}})
    assert updates == {"w1": {"chat": {"a": 50.0}}}
    assert exchange.elsewhere("w2", "chat") == {"a": 100.0, "b": 10.0}
    updates = exchange.report("w3", {"chat": {"b": 5.0}, "other": {"a": 1.0}})
    assert updates == {"w1": {"chat": {"a": 50.0, "b": 5.0}}, "w2": {"chat": {"a": 100.0, "b": 15.0}}}


def test_a_worker_that_leaves_no_longer_counts() -> None:
    exchange = TenantServiceExchange()
    exchange.report("w1", {"chat": {"a": 100.0}})
    exchange.report("w2", {"chat": {"a": 50.0}})
    assert exchange.forget("w1") == {"w2": {"chat": {}}}
    assert exchange.forget("nobody") == {}
