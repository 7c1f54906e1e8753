"""How long a model whose engine keeps crashing waits before it is loaded again.

Pure bookkeeping over an injected time: the pool records each crash of a loaded engine (an
engine process that exited by itself) and gets back the delay before the next load. The
first crash in `window_s` reloads at once (the next request loads the model again); each
further one doubles the wait from `first_s`, up to `max_s`. Crashes older than `window_s`
are forgotten, so a model that ran well for that long starts again from no delay.

    backoff = CrashBackoff(first_s=1.0, max_s=60.0, window_s=300.0)
    delay = backoff.crashed("tiny-chat-process", now=clock.monotonic())   # 0, 0, 1, 2, 4 ...
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CrashBackoff"]


@dataclass(slots=True)
class CrashBackoff:
    first_s: float = 1.0
    max_s: float = 60.0
    window_s: float = 300.0
    free_crashes: int = 1  # crashes in the window that reload without a wait
    _crashes: dict[str, list[float]] = field(default_factory=dict)

    def crashed(self, model_id: str, *, now: float) -> float:
        """Record a crash of `model_id` at `now`; the seconds its next load must wait."""
        recent = [t for t in self._crashes.get(model_id, []) if now - t < self.window_s]
        recent.append(now)
        self._crashes[model_id] = recent
        extra = len(recent) - self.free_crashes
        if extra <= 0:
            return 0.0
        return min(self.max_s, self.first_s * 2 ** (extra - 1))

    def crashes(self, model_id: str, *, now: float) -> int:
        """Crashes of `model_id` within the window before `now`."""
        return sum(1 for t in self._crashes.get(model_id, []) if now - t < self.window_s)
