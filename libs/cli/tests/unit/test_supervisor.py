"""The restart budget and backoff, and the supervision loop's decisions, on an injected clock."""

from __future__ import annotations

import threading

from loadmaster.cli.supervisor import RestartBudget, RestartPolicy, describe_exit, supervise


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_and_the_budget_runs_out_then_refills() -> None:
    clock = _Clock()
    budget = RestartBudget(RestartPolicy(max_restarts=3, window_s=60, backoff_initial_s=0.5), clock)
    assert [budget.on_exit() for _ in range(3)] == [0.5, 1.0, 2.0]
    assert budget.on_exit() is None  # a fourth exit within the window: give up
    clock.now += 61
    assert budget.on_exit() == 0.5  # up for a whole window: a fresh budget


def test_backoff_is_capped() -> None:
    policy = RestartPolicy(max_restarts=10, backoff_initial_s=1, backoff_max_s=3)
    budget = RestartBudget(policy, _Clock())
    assert [budget.on_exit() for _ in range(4)] == [1, 2, 3, 3]


def test_describe_exit() -> None:
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(3) == "exited with code 3"


class _FlappingSuite:
    """A suite whose `name` process dies again right after every restart."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        self.restarts: list[str] = []

    def crashed(self) -> list[tuple[str, int]]:
        self.clock.now += 0.5
        return [("scheduler", -9)]

    def restart(self, name: str, *, timeout_s: float) -> None:
        self.restarts.append(name)

    def log_tail(self, name: str, lines: int = 20) -> str:
        return "last words"


def test_supervise_restarts_within_the_budget_then_gives_up() -> None:
    clock = _Clock()
    suite = _FlappingSuite(clock)
    said: list[str] = []
    policy = RestartPolicy(max_restarts=2, window_s=60, backoff_initial_s=0.1)
    code = supervise(suite, threading.Event(), said.append, policy=policy, clock=clock, poll_s=0)
    assert code == 1
    assert suite.restarts == ["scheduler", "scheduler"]
    assert "scheduler killed by SIGKILL; restart 1/2 in 0.1 s" in said[0]
    assert "giving up" in said[-1] and "last words" in said[-1]


def test_supervise_returns_0_when_stopped() -> None:
    stop = threading.Event()
    stop.set()
    assert supervise(_FlappingSuite(_Clock()), stop, print) == 0
