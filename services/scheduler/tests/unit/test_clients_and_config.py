"""ClientTracker (cadence, liveness), policy modules, and CoreConfig from Settings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from loadmaster.common.config import load_settings
from loadmaster.common.ordering import get_policy, load_policy_modules
from loadmaster.common.ordering.clients import ClientTracker
from loadmaster.scheduler.config import CoreConfig, strategy_factory
from loadmaster.scheduler.domain import OverflowPolicy


def test_cadence_is_an_ewma_of_gaps() -> None:
    t = ClientTracker(cadence_alpha=0.5, disconnect_timeout_s=10)
    assert t.observe("c", 0.0) is True  # new
    assert t.cadence_ms("c") is None
    t.observe("c", 0.1)
    assert t.cadence_ms("c") == pytest.approx(100.0)
    t.observe("c", 0.12)  # 0.5 x 20 + 0.5 x 100
    assert t.cadence_ms("c") == pytest.approx(60.0)
    t2 = ClientTracker(cadence_alpha=0.1, disconnect_timeout_s=10)  # alpha matters
    for at in (0.0, 0.1, 0.12):
        t2.observe("c", at)
    assert t2.cadence_ms("c") == pytest.approx(92.0)


def test_liveness_one_entry_per_client_and_one_report_per_silence() -> None:
    t = ClientTracker(cadence_alpha=0.3, disconnect_timeout_s=1.0)
    for i in range(100):
        t.observe("busy", i * 0.005)  # many requests: still one pending check
    t.observe("quiet", 0.0)
    assert t.next_check() == 1.0 and t.active == 2
    assert t.due_disconnects(1.0) == ["quiet"]  # busy was seen at 0.495: re-armed, not reported
    assert t.next_check() == pytest.approx(1.495)
    assert t.due_disconnects(1.2) == []
    assert t.due_disconnects(5.0) == ["busy"]
    assert t.due_disconnects(50.0) == [] and t.active == 0 and t.next_check() is None
    assert t.observe("quiet", 60.0) is True and t.active == 1  # back as a new client


def test_bad_alpha_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cadence_alpha"):
        ClientTracker(cadence_alpha=1.5)


def test_policy_modules_register_their_policies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "site_policies.py").write_text(
        "from loadmaster.common.ordering import register_policy\n"
        "@register_policy('site-urgent-first')\n"
        "def urgent(r):\n    return 5.0 if r.urgency > 0.5 else 500.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    load_policy_modules(["site_policies"])
    assert get_policy("site-urgent-first") is not None
    with pytest.raises(ValueError, match="policy_modules: cannot import 'no_such_module_xyz'"):
        load_policy_modules(["no_such_module_xyz"])
    sys.modules.pop("site_policies", None)


def test_core_config_merges_per_model_and_per_client_settings() -> None:
    settings = load_settings(
        None,
        scheduler={"max_queue_size": 50, "request_ttl_ms": 900.0, "strategy": "round_robin"},
        models={
            "defaults": {"max_inflight": 3},
            "known": {
                "fast": {"latest_only": True, "request_ttl_ms": 40.0, "overflow_policy": "reject_newest"},
                "eager": {"latest_only": True, "dispatch_credits": 2},
            },
        },
        clients={"known": {"arm": {"latency_budget_ms": 20.0}}},
        response_tracking={"cadence_alpha": 0.4, "disconnect_timeout_s": 3.0},
    )
    config = CoreConfig.from_settings(settings)
    # What a gateway's local queue is sent of the client budgets (docs/data-path.md).
    assert (config.default_latency_budget_ms, config.client_latency_budgets_ms) == (50.0, {"arm": 20.0})
    fast, other = config.policy("fast"), config.policy("other")
    assert (fast.latest_only, fast.request_ttl_ms, fast.overflow_policy, fast.max_queue_size) == (
        True,
        40.0,
        OverflowPolicy.REJECT_NEWEST,
        50,
    )
    assert (other.latest_only, other.request_ttl_ms, other.overflow_policy) == (
        False,
        900.0,
        OverflowPolicy.DROP_OLDEST,
    )
    # Credits: the global default, or the model's own (a latest_only model is never lent: the
    # dispatcher asks `local_queue_spec`, tested with the core).
    assert (other.dispatch_credits, fast.dispatch_credits, config.policy("eager").dispatch_credits) == (
        64,
        64,
        2,
    )
    assert config.max_inflight("fast") == 3
    assert config.latency_budget_ms("arm") == 20.0 and config.latency_budget_ms("x") == 50.0
    assert (config.cadence_alpha, config.disconnect_timeout_s) == (0.4, 3.0)
    make = strategy_factory(settings)
    assert make(settings.scheduler.strategy, None).name == "round_robin"
    batch = make("batch_optimized", None).batch
    assert batch is not None and batch.max_batch_size == 8


def test_default_strategy_is_model_deadline() -> None:
    assert load_settings(None).scheduler.strategy == "model_deadline"


EXAMPLE_CONFIG = Path(__file__).resolve().parents[4] / "examples" / "loadmaster.yaml"
_SCALARS = (
    "max_queue_size",
    "request_ttl_ms",
    "overflow_policy",
    "max_retries",
    "cadence_alpha",
    "disconnect_timeout_s",
    "dispatch_credits",
    "credit_window_s",
    "lookahead",
)


@pytest.mark.parametrize(
    "path", [None, EXAMPLE_CONFIG], ids=["settings_defaults", "examples_loadmaster_yaml"]
)
def test_a_bare_core_config_schedules_as_shipped(path: Path | None) -> None:
    """CoreConfig's defaults are the shipped settings' (credits on, their local queues staging
    the `lookahead`), so a test that builds a bare CoreConfig runs what a deployed scheduler runs."""
    shipped = CoreConfig.from_settings(load_settings(path))
    bare = CoreConfig()
    assert {name: getattr(bare, name) for name in _SCALARS} == {
        name: getattr(shipped, name) for name in _SCALARS
    }
    assert (bare.dispatch_credits, bare.lookahead) == (64, 1)
    mechanisms = ("dispatch_credits", "lookahead", "max_queue_size", "request_ttl_ms")
    policy, shipped_policy = bare.policy("any"), shipped.policy("any")
    assert {m: getattr(policy, m) for m in mechanisms} == {m: getattr(shipped_policy, m) for m in mechanisms}
    assert bare.max_inflight("any") == shipped.max_inflight("any") == 2
