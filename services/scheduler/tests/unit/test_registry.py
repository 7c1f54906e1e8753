"""WorkerRegistry: grant candidates, and what it knows about models, after every kind of change."""

from __future__ import annotations

from loadmaster.scheduler.domain import SlotState, SlotStatus, WorkerHello
from loadmaster.scheduler.registry import WorkerRegistry


def _inflight(registry: WorkerRegistry, model_id: str) -> dict[str, int]:
    return {c.worker_id: c.inflight for c in registry.grant_candidates(model_id)}


def test_grant_candidates_follow_grants_reports_and_losses() -> None:
    registry = WorkerRegistry()
    registry.add(WorkerHello("a", "tcp://a", repository=("m",)))
    registry.add(WorkerHello("b", "tcp://b", repository=("m", "n")))
    assert registry.grant_candidates("m") == ()  # nothing READY yet
    registry.report("a", [SlotStatus("m", SlotState.READY)])
    registry.report("b", [SlotStatus("m", SlotState.READY, inflight=3), SlotStatus("n", SlotState.LOADING)])
    assert _inflight(registry, "m") == {"a": 0, "b": 0}  # registration order
    assert [c.reported_load for c in registry.grant_candidates("m")] == [0, 3]
    registry.acquire("a", (1, "r1"), "m")
    registry.acquire("a", (1, "r2"), "m")
    registry.acquire("b", (1, "r3"), "m")
    assert _inflight(registry, "m") == {"a": 2, "b": 1}
    registry.release("a", (1, "r1"))
    registry.release("a", (1, "r1"))  # a second release of the same grant changes nothing
    assert _inflight(registry, "m") == {"a": 1, "b": 1}
    # a new report keeps the scheduler's own count of grants in flight
    registry.report("a", [SlotStatus("m", SlotState.READY, inflight=0)])
    assert _inflight(registry, "m") == {"a": 1, "b": 1}
    registry.report("b", [SlotStatus("m", SlotState.DRAINING)])
    assert _inflight(registry, "m") == {"a": 1}
    registry.release("b", (1, "r3"))  # a grant on a slot that is no longer READY still completes
    assert registry.inflight("m") == 1
    registry.remove("a")
    assert registry.grant_candidates("m") == ()


def test_knows_and_holds_after_hello_report_and_loss() -> None:
    registry = WorkerRegistry()
    assert not registry.knows("m") and not registry.holds("m")
    registry.add(WorkerHello("a", "tcp://a", repository=("m",)))
    assert registry.knows("m") and not registry.holds("m")
    registry.report("a", [SlotStatus("m", SlotState.LOADING), SlotStatus("x", SlotState.IDLE)])
    assert registry.holds("m") and registry.knows("x") and not registry.holds("x")
    registry.report("a", [SlotStatus("m", SlotState.READY)])
    assert registry.holds("m") and not registry.knows("x")
    registry.remove("a")
    assert not registry.knows("m") and not registry.holds("m")
