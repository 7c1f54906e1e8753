"""The dispatch credits this gateway holds (scheduler.proto `Credit`): worker slots the scheduler
lent it, which of them are idle, and which scheduler session lent each.

Credits of a lost session stay usable while no scheduler serves (docs/deploy.md, "Scheduler
failover"), until the next session first grants or lends something (`heard`), and at most
`OLD_SHARE_GRACE_S` after that session opened; from then on they are dropped unreturned as they
come up, since that session's scheduler never lent them. (The bound matters: a gateway serving
everything on old credits, with a local queue, sends the new scheduler nothing to grant, so it
would never hear from it; and an old credit's worker may die with nobody left to revoke it.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loadmaster.common.clock import Clock
from loadmaster.common.ordering import SortKey
from loadmaster.v1 import scheduler_pb2

__all__ = ["OLD_SHARE_GRACE_S", "HeldCredit", "HeldCredits"]

# How long after a new scheduler session opens the lost session's credits may still serve:
# the new scheduler's workers reconnect to it within ~1 s of the gateway (scheduler failover
# test: gateway 2.1 s, worker 2.5 s after the kill).
OLD_SHARE_GRACE_S = 5.0


@dataclass(slots=True)
class HeldCredit:
    """A worker slot the scheduler lent this gateway."""

    credit_id: str
    model_id: str
    worker_id: str
    data_endpoint: str
    generation: int
    request_ttl_ms: float
    # The calls sent on it and not yet answered, in the order its worker will run them: the
    # first runs, the others wait at the worker (staged, or sent ahead of those with
    # front_of_queue). Empty: idle.
    calls: list[str] = field(default_factory=list)
    staged: dict[str, SortKey] = field(default_factory=dict)  # waiting ones, not front: their keys
    fronts: set[str] = field(default_factory=set)  # waiting ones sent with front_of_queue
    revoked: bool = False  # revoked, or its worker failed: takes no more calls, returned once idle
    session: int = 0  # the scheduler session that lent it
    started_at: float = 0.0  # when its running call started (monotonic), as near as known

    def sent(self, request_id: str, now: float, key: SortKey | None = None, *, front: bool = False) -> None:
        """A call went to the credit's worker at `now`: to run now (idle), behind those there
        (`key`: its place in the local order), or ahead of the waiting ones (`front`, after
        earlier fronts)."""
        calls = self.calls
        if not calls:
            self.started_at = now
        if not front:
            if calls and key is not None:
                self.staged[request_id] = key
            calls.append(request_id)
            return
        at = 1
        while at < len(calls) and calls[at] in self.fronts:
            at += 1
        calls.insert(at, request_id)
        self.fronts.add(request_id)

    def ended(self, request_id: str, now: float) -> None:
        """A call sent on it has its answer at `now`; the next one (as the worker orders them) runs."""
        self.calls.remove(request_id)
        self.fronts.discard(request_id)
        self.staged.pop(request_id, None)
        if self.calls:
            self.started_at = now
            self.fronts.discard(self.calls[0])
            self.staged.pop(self.calls[0], None)

    def least_urgent_staged(self) -> SortKey | None:
        return max(self.staged.values(), default=None)


class HeldCredits:
    def __init__(self, clock: Clock, *, old_share_grace_s: float = OLD_SHARE_GRACE_S) -> None:
        self._clock = clock
        self._old_share_grace_s = old_share_grace_s
        self._session = 0  # the newest session seen, and since when (monotonic)
        self._session_since = -math.inf
        self._credits: dict[str, HeldCredit] = {}
        # model -> idle credits, the longest idle first (rotating spreads calls over them)
        self._idle: dict[str, list[HeldCredit]] = {}
        # The last scheduler session that granted or lent anything: until the current one has,
        # its scheduler may know no worker yet, and the credits of the session before still serve.
        self._heard_session = 0

    def heard(self, session: int) -> None:
        """The session granted or lent something: its scheduler serves."""
        self._heard_session = session

    def get(self, credit_id: str) -> HeldCredit | None:
        return self._credits.get(credit_id)

    def add(self, credit: scheduler_pb2.Credit, session: int) -> HeldCredit:
        """A credit lent on `session`, idle until a call takes it."""
        self._heard_session = session
        held = HeldCredit(
            credit_id=credit.credit_id,
            model_id=credit.model_id,
            worker_id=credit.worker_id,
            data_endpoint=credit.data_endpoint,
            generation=credit.generation,
            request_ttl_ms=credit.request_ttl_ms,
            session=session,
        )
        self._credits[held.credit_id] = held
        self._idle.setdefault(held.model_id, []).append(held)
        return held

    def has_idle(self, model_id: str) -> bool:
        return bool(self._idle.get(model_id))

    def _usable(self, credit: HeldCredit, connected: bool, session: int) -> bool:
        """Lent by the current `session`, or by an earlier one while none other serves (no
        session connected, or the current one has not granted or lent anything yet, for at most
        the grace after it opened)."""
        if not connected or credit.session == session:
            return True
        if self._heard_session == session:
            return False
        now = self._clock.monotonic()
        if session != self._session:
            self._session, self._session_since = session, now
        return now - self._session_since < self._old_share_grace_s

    def take_idle(self, model_id: str, *, connected: bool, session: int) -> HeldCredit | None:
        """An idle credit for `model_id` (the longest idle), dropping those an earlier session
        lent once the current `session` has granted or lent anything."""
        idle = self._idle.get(model_id)
        while idle:
            credit = idle.pop(0)
            if self._usable(credit, connected, session):
                return credit
            self.forget(credit)
        return None

    def busy(self, model_id: str, *, connected: bool, session: int) -> list[HeldCredit]:
        """The model's usable credits, not revoked, that run a call (to stage calls behind)."""
        return [
            c
            for c in self._credits.values()
            if c.calls and c.model_id == model_id and not c.revoked and self._usable(c, connected, session)
        ]

    def idle_again(self, credit: HeldCredit) -> bool:
        """The credit's call ended and it is still held: idle again; False if it is gone."""
        if self._credits.get(credit.credit_id) is not credit:
            return False
        self._idle[credit.model_id].append(credit)
        return True

    def revoke(self, credit_id: str) -> HeldCredit | None:
        """Mark it revoked; an idle one leaves the idle list (to be returned at once)."""
        credit = self._credits.get(credit_id)
        if credit is None:
            return None
        credit.revoked = True
        if not credit.calls:
            self._idle[credit.model_id].remove(credit)
        return credit

    def forget(self, credit: HeldCredit) -> bool:
        """Stop holding it; True if it was held (so it is to be returned). A scheduler that took
        over numbers its credits afresh: one lent under an earlier session's id is another credit."""
        if self._credits.get(credit.credit_id) is not credit:
            return False
        del self._credits[credit.credit_id]
        return True

    def live(self, model_id: str, *, connected: bool, session: int) -> bool:
        """A credit for the model is held, not revoked, and usable (see `take_idle`)."""
        return any(
            c.model_id == model_id and not c.revoked and self._usable(c, connected, session)
            for c in self._credits.values()
        )

    def counts(self) -> dict[str, int]:
        """Per model, the credits held and not revoked."""
        out: dict[str, int] = {}
        for credit in self._credits.values():
            if not credit.revoked:
                out[credit.model_id] = out.get(credit.model_id, 0) + 1
        return out
