"""The VRAM gate and load time against deadlines (docs/vram-gate.md): a load refused for want
of GPU memory keeps its waiters queued and is tried again; a request whose deadline cannot
cover the model's load is refused at once."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from loadmaster.scheduler.domain import LoadModel, SlotState, SlotStatus
from loadmaster.v1 import errors_pb2

if TYPE_CHECKING:
    from conftest import Harness, MakeHarness

READY, LOADING, IDLE = SlotState.READY, SlotState.LOADING, SlotState.IDLE
EXPIRED = errors_pb2.ERROR_CODE_EXPIRED
NO_MEMORY = (
    "no GPU memory for model 'm' (600 MB) and nothing can be evicted: no evictable model; "
    "evicting every evictable model would not make room (broker: 400 MB free on GPU 0)"
)


@pytest.fixture
def g(make_harness: MakeHarness) -> Harness:
    """TTL 10 s, the gate retries every 1 s."""
    return make_harness(request_ttl_ms=10_000.0, vram_gate_retry_ms=1000.0)


def _refused_for_memory(h: Harness, *, gen: int = 1) -> None:
    h.report("w1", {"m": LOADING}, gen=gen)
    h.report("w1", {"m": IDLE}, error=NO_MEMORY, gen=gen)


def test_a_load_refused_for_memory_keeps_its_waiters_and_is_tried_again(g: Harness) -> None:
    g.worker("w1", ["m"])
    g.enqueue("r1", "r2")
    assert g.commands == [("w1", LoadModel("m"))]
    _refused_for_memory(g)
    assert g.rejects() == [] and g.state("r1") == "queued" and g.state("r2") == "queued"
    assert g.core.next_deadline() == pytest.approx(g.clock.monotonic() + 1.0)
    g.enqueue("r3")  # a new waiter does not hammer the worker with loads
    g.advance(0.5)
    assert len(g.commands) == 1
    g.advance(0.5)
    assert g.commands == [("w1", LoadModel("m"))] * 2
    _refused_for_memory(g, gen=2)  # still no room
    g.advance(1.0)
    assert len(g.commands) == 3
    g.report("w1", {"m": LOADING}, gen=3)
    g.report("w1", {"m": READY}, gen=3)  # the training job ended: it fits
    assert g.granted_ids() == ["r1"]
    for request_id in ("r1", "r2", "r3"):
        g.complete(request_id)
    assert g.granted_ids() == ["r1", "r2", "r3"]
    assert g.core.next_deadline() is None or g.core.next_deadline() > g.clock.monotonic() + 5.0
    g.check(settled=True)


def test_a_request_that_waited_for_memory_past_its_deadline_says_so(g: Harness) -> None:
    g.worker("w1", ["m"])
    g.enqueue("short", timeout_ms=2500.0)
    _refused_for_memory(g)
    g.advance(2.5)
    (reject,) = g.rejects()
    assert reject.request_id == "short" and reject.error_code == EXPIRED
    assert "waiting for GPU memory" in reject.message and "no GPU memory for model 'm'" in reject.message
    # Nobody waits any more: the gate is lifted and no further load is commanded.
    commands = len(g.commands)
    g.advance(5.0)
    assert len(g.commands) == commands
    assert g.core.next_deadline() is None
    g.check(settled=True)


def test_an_unload_on_a_worker_lets_a_gated_load_try_at_once(g: Harness) -> None:
    g.worker("w1", ["m", "x"])
    g.report("w1", {"x": READY})
    g.enqueue("r")
    g.report("w1", {"x": READY, "m": LOADING})
    g.report("w1", {"x": READY, "m": IDLE}, error=NO_MEMORY)
    assert len(g.commands) == 1
    g.report("w1", {"x": IDLE, "m": IDLE}, error=NO_MEMORY)  # x was evicted or unloaded
    assert g.commands == [("w1", LoadModel("m"))] * 2  # without waiting for the retry timer


def test_a_load_failure_that_is_not_about_memory_still_rejects_at_once(g: Harness) -> None:
    g.worker("w1", ["m"])
    g.enqueue("r")
    g.report("w1", {"m": LOADING})
    g.report("w1", {"m": IDLE}, error="model.py: SyntaxError")
    (reject,) = g.rejects()
    assert "SyntaxError" in reject.message and reject.error_code == errors_pb2.ERROR_CODE_UNAVAILABLE


def _last_load_took(h: Harness, ms: float) -> None:
    h.core.update_worker("w1", [SlotStatus("m", IDLE, generation=1, load_time_ms=ms)])


def test_load_time_counts_against_the_deadline(g: Harness) -> None:
    g.worker("w1", ["m"])
    _last_load_took(g, 3000.0)  # loaded and evicted before: a load takes about 3 s
    g.enqueue("hurried", timeout_ms=500.0)
    (reject,) = g.rejects()
    assert reject.error_code == EXPIRED
    assert "needs about 3000 ms" in reject.message and "500 ms deadline" in reject.message
    assert g.commands == []  # refused before anything was loaded for it
    g.enqueue("patient", timeout_ms=5000.0)
    assert g.commands == [("w1", LoadModel("m"))]
    g.advance(2.0)  # one second of the load left
    g.enqueue("late", timeout_ms=500.0)
    g.enqueue("in-time", timeout_ms=1500.0)
    assert [r.request_id for r in g.rejects()] == ["hurried", "late"]
    assert "is loading and needs about 1000 ms more" in g.rejects()[-1].message
    g.core.update_worker("w1", [SlotStatus("m", READY, generation=2, load_time_ms=3000.0)])
    assert g.granted_ids() == ["patient"]
    g.complete("patient")
    g.complete("in-time")
    g.check(settled=True)


def test_a_request_that_expires_while_its_model_loads_says_so(g: Harness) -> None:
    g.worker("w1", ["m"])
    g.enqueue("r", timeout_ms=1000.0)  # no load time known yet: it waits
    g.report("w1", {"m": LOADING})
    g.advance(1.0)
    (reject,) = g.rejects()
    assert reject.error_code == EXPIRED and "still loading" in reject.message


def test_a_model_that_can_never_fit_is_refused_at_once_not_gated(g: Harness) -> None:
    g.worker("w1", ["m"])
    g.enqueue("r")
    g.report("w1", {"m": LOADING})
    never = (
        "no GPU memory for model 'm' (64 MB) and nothing can be evicted: no evictable model "
        "(64 MB can never fit on node 'local': even with no leases the most it could get is 26 MB)"
    )
    g.report("w1", {"m": IDLE}, error=never)
    (reject,) = g.rejects()
    assert reject.error_code == errors_pb2.ERROR_CODE_UNAVAILABLE and "can never fit" in reject.message
