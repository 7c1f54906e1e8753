"""`loadmaster up` keeps the suite running: a service (or the embedded redis-server) that exits
is started again, after an exponential backoff, within a restart budget.

Each process has its own budget: at most `max_restarts` restarts within `window_s` seconds.
The delay before a restart doubles with each exit inside the window (`backoff_initial_s`,
then 2x, 4x, ... up to `backoff_max_s`); a process that stays up for a whole window starts
afresh. When a process exits once more with its budget spent, the supervisor gives up:
`loadmaster up` stops everything and exits 1. Every exit is logged with its status.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["RestartBudget", "RestartPolicy", "SupervisedSuite", "describe_exit", "supervise"]


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    max_restarts: int = 5
    window_s: float = 60.0
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 5.0
    restart_timeout_s: float = 60.0  # a restarted service must be healthy within this


@dataclass(slots=True)
class RestartBudget:
    """One process's restarts; `on_exit()` says how long to wait before the next one, or None
    when the budget is spent."""

    policy: RestartPolicy
    clock: Callable[[], float] = time.monotonic
    _restarts: deque[float] = field(default_factory=deque)

    def on_exit(self) -> float | None:
        now = self.clock()
        while self._restarts and now - self._restarts[0] > self.policy.window_s:
            self._restarts.popleft()
        if len(self._restarts) >= self.policy.max_restarts:
            return None
        delay = min(self.policy.backoff_max_s, self.policy.backoff_initial_s * 2 ** len(self._restarts))
        self._restarts.append(now)
        return delay

    @property
    def used(self) -> int:
        return len(self._restarts)


class SupervisedSuite(Protocol):
    def crashed(self) -> list[tuple[str, int]]: ...

    def restart(self, name: str, *, timeout_s: float) -> None: ...

    def log_tail(self, name: str, lines: int = 20) -> str: ...


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def supervise(
    suite: SupervisedSuite,
    stop: threading.Event,
    say: Callable[[str], None],
    *,
    policy: RestartPolicy = RestartPolicy(),
    clock: Callable[[], float] = time.monotonic,
    poll_s: float = 0.1,
) -> int:
    """Watch until `stop` is set (0) or a budget is spent (1); restart what exits meanwhile."""
    budgets: dict[str, RestartBudget] = {}
    due: dict[str, float] = {}  # name -> when to restart it
    while not stop.wait(poll_s):
        for name, returncode in suite.crashed():
            if name in due:
                continue
            budget = budgets.setdefault(name, RestartBudget(policy, clock))
            delay = budget.on_exit()
            tail = suite.log_tail(name)
            if delay is None:
                say(
                    f"[red]{name} {describe_exit(returncode)}; {policy.max_restarts} restarts within "
                    f"{policy.window_s:g} s already: giving up[/red]" + (f"\n{tail}" if tail else "")
                )
                return 1
            say(
                f"[yellow]{name} {describe_exit(returncode)}; restart {budget.used}/"
                f"{policy.max_restarts} in {delay:.1f} s[/yellow]" + (f"\n{tail}" if tail else "")
            )
            due[name] = clock() + delay
        for name, at in sorted(due.items(), key=lambda item: item[1]):
            if stop.is_set() or clock() < at:
                continue
            del due[name]
            started = clock()
            try:
                suite.restart(name, timeout_s=policy.restart_timeout_s)
            except (RuntimeError, TimeoutError) as error:
                # It will show up in crashed() again (or is still down): the budget decides.
                say(f"[red]{name} restart failed: {error}[/red]")
                continue
            say(f"[green]{name} restarted, healthy after {clock() - started:.1f} s[/green]")
    return 0
