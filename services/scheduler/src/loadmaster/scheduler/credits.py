"""Dispatch credits: worker slots lent to gateways, so their requests skip the scheduler.

The uncontended path should not pay a scheduler round trip per request. So while a model
has no waiters here, the core lends the free slots of workers holding it READY to the
gateway sessions that used it within `window_s` (its borrowers). A gateway sends a request
on an idle credit straight to the credit's worker and reports it afterwards (a `CreditRun`,
batched with others, or only counted in a `RunTally`); the scheduler tracks it like a
granted request.

Every credit carries a `LocalQueueSpec`: a gateway queues its own requests that find no
idle credit and ranks them with the same strategy code (loadmaster.common.ordering; a
registered policy too, loaded by the gateway from the same `scheduler.policy_modules`), so the
scheduler sees no queue for the model (docs/data-path.md). A model is lent only while every
one of its slots may be: its strategy is one a gateway can keep (not `batch_optimized`, whose
groups form here), it is not `latest_only` (a gateway's queue never supersedes), and it has no
more slots than `dispatch_credits`. Any other model's requests are all queued and granted here.

Shares between gateways. A model with several borrowers is split: every `period_s` the
book measures each borrower's demand (its calls waiting in its local queue or running on its
credits, on average over the period, as its gateway reports them, plus its requests waiting
here) and gives each a share of the slots in proportion (at least one slot each while there are enough), revoking what a gateway holds
over its share (it returns an idle credit at
once, a busy one when its call ends) and lending freed slots to the gateway furthest under
its share. Each gateway keeps ordering its own requests. A request that waits here (its
gateway holds no credit for the model: a newcomer, or one whose share is 0) reclaims one
credit from the gateway most over its share, and is granted the slot when it comes back:
one call's remainder plus a round trip, with no pause.

A lent slot counts against the worker's `max_inflight` until the gateway returns the
credit, so a revocation never lets a worker be granted more than it may run.
`CreditBook` keeps the credits, holds their slots in the worker registry and sends
credits and revocations out; the core decides when to lend, reclaim and revoke.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from loadmaster.common.ordering import DeadlineTerms, Ordering
from loadmaster.scheduler.config import CoreConfig, ModelPolicy
from loadmaster.scheduler.domain import (
    Credit,
    LocalQueueSpec,
    OverflowPolicy,
    RequestKey,
    SlotState,
    SlotStatus,
)
from loadmaster.scheduler.outbound import Outbound, Telemetry
from loadmaster.scheduler.registry import WorkerRegistry

__all__ = ["CreditBook", "local_queue_spec"]


def local_queue_spec(ordering: Ordering, policy: ModelPolicy, config: CoreConfig) -> LocalQueueSpec | None:
    """How a gateway holding a share of the model queues for it, or None when it may not:
    `batch_optimized` (its groups form in the scheduler's queue), or a model whose queue
    supersedes (`latest_only`). `deadline_aware` and `tiered_deadline` are global, but within
    one model their keys are the deadline family's (tiers travel in the spec): their scope only
    orders the grants of several models that can go in one dispatch round, and a share's calls
    take no central grant."""
    if ordering.batch is not None or policy.latest_only:
        return None
    return LocalQueueSpec(
        strategy=ordering.name,
        terms=getattr(ordering, "terms", None) or DeadlineTerms(),
        latency_budget_ms=config.default_latency_budget_ms,
        client_latency_budget_ms=config.client_latency_budgets_ms,
        cadence_alpha=config.cadence_alpha,
        max_queue_size=policy.max_queue_size,
        reject_newest=policy.overflow_policy is OverflowPolicy.REJECT_NEWEST,
        tiers=tuple(getattr(ordering, "tiers", None) or ()),
        stage=policy.lookahead,
        policy=getattr(ordering, "policy_name", ""),
    )


def _idle_first(credit: Credit) -> tuple[bool, int]:
    """The order credits are revoked in: those with no run known here first (idle, or running a
    call not reported yet), then the oldest."""
    return bool(credit.running), int(credit.credit_id[1:])


class CreditBook:
    def __init__(
        self,
        window_s: float,
        *,
        registry: WorkerRegistry,
        outbound: Outbound,
        telemetry: Telemetry,
        period_s: float = 0.5,
        central: Callable[[str], Mapping[int, int]] = lambda model_id: {},
    ) -> None:
        """`central(model)`: how many of the model's requests wait here, per session."""
        self._window_s = window_s
        self._period_s = period_s
        self._central = central
        self._registry = registry
        self._out = outbound
        self._telemetry = telemetry
        self._credits: dict[str, Credit] = {}
        self._by_model: dict[str, set[str]] = {}
        self._ids = itertools.count(1)
        self._users: dict[str, dict[int, float]] = {}  # model -> session -> last use (monotonic)
        self._accepting: set[int] = set()
        self._local_depths: dict[str, dict[int, int]] = {}  # model -> session -> waiting there
        # Split models (several borrowers): when each was last measured, each session's demand
        # reported since then (call-seconds), and the slots each session should hold.
        self._split: dict[str, float] = {}
        self._demand_s: dict[str, dict[int, float]] = {}
        self._targets: dict[str, dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self._credits)

    def get(self, credit_id: str) -> Credit | None:
        return self._credits.get(credit_id)

    def idle(self, model_id: str) -> int:
        """Credits for the model with nothing running on them."""
        return sum(1 for i in self._by_model.get(model_id, ()) if not self._credits[i].running)

    def lent(self, model_id: str) -> int:
        """Credits for the model not returned yet (revoked ones included)."""
        ids = self._by_model.get(model_id)
        return len(ids) if ids else 0

    def note_local_depth(
        self, session_id: int, model_id: str, waiting: int, outstanding_s: float = 0.0
    ) -> None:
        """The session's gateway reports how many requests wait in its local queue, and its
        demand since its last report (call-seconds waiting there or running on its credits)."""
        if outstanding_s and (demand := self._demand_s.get(model_id)) is not None:
            demand[session_id] = demand.get(session_id, 0.0) + outstanding_s
        depths = self._local_depths.setdefault(model_id, {})
        if waiting:
            depths[session_id] = waiting
        else:
            depths.pop(session_id, None)

    def local_depth(self, model_id: str) -> int:
        depths = self._local_depths.get(model_id)
        return sum(depths.values()) if depths else 0

    # ---- sessions and their use of models ---------------------------------------

    def accept(self, session_id: int) -> None:
        """The session's gateway understands credits."""
        self._accepting.add(session_id)

    def note_use(self, model_id: str, session_id: int, now: float) -> None:
        users = self._users.get(model_id)
        if users is None:
            users = self._users[model_id] = {}
        users[session_id] = now

    def borrowers(self, model_id: str, now: float) -> list[int]:
        """The sessions to lend the model's slots to: those that used it within the window (the
        last one stays a borrower however long ago), none while a recent user does not accept
        credits."""
        users = self._users.get(model_id)
        if not users:
            return []
        horizon = now - self._window_s
        if len(users) > 1:
            latest = max(users, key=users.__getitem__)
            for session_id in [s for s, last in users.items() if last < horizon and s != latest]:
                del users[session_id]
        if any(session_id not in self._accepting for session_id in users):
            return []
        return sorted(users)

    # ---- lending and taking back -----------------------------------------------

    def lend(
        self,
        model_id: str,
        now: float,
        *,
        ttl_ms: float,
        pick: Callable[[], str | None],
        spec: LocalQueueSpec,
    ) -> None:
        """Lend the model's free slots (`pick` names a worker with one, or None) to its
        borrowers, every credit carrying `spec`: a gateway queues its own calls that find no
        idle credit. The caller lends only models whose every slot may be lent (else a
        gateway's queued calls could wait while a slot nobody holds stays idle)."""
        borrowers = self.borrowers(model_id, now)
        if not borrowers:
            return
        lent: list[Credit] = []
        while (worker_id := pick()) is not None:
            lent.append(self._new_credit(model_id, borrowers[0], worker_id, ttl_ms))
        if len(borrowers) > 1 and lent:
            targets = self._targets.get(model_id)
            if targets is None or set(targets) != set(borrowers):
                targets = self._plan(model_id, borrowers, now)
            held = self._held(model_id)
            for credit in lent:
                held[credit.session_id] -= 1
                credit.session_id = self._neediest(model_id, targets, held)
                held[credit.session_id] += 1
        for credit in lent:
            credit.local_queue = spec
            self._out.lend_credit(credit.session_id, credit)
            self._telemetry.record("credits_lent", 1, {"model": model_id})

    def lend_to(
        self,
        model_id: str,
        session_id: int,
        now: float,
        *,
        ttl_ms: float,
        pick: Callable[[], str | None],
        spec: LocalQueueSpec,
    ) -> bool:
        """Lend one free slot of a model whose slots are lent with local queues to a session
        whose requests wait here (it holds none of them); False when no slot is free."""
        worker_id = pick()
        if worker_id is None:
            return False
        credit = self._new_credit(model_id, session_id, worker_id, ttl_ms)
        credit.local_queue = spec
        if model_id not in self._split:  # shared now: measured from here on
            self._split[model_id] = now
            self._demand_s[model_id] = {}
        self._out.lend_credit(session_id, credit)
        self._telemetry.record("credits_lent", 1, {"model": model_id})
        return True

    def _new_credit(self, model_id: str, session_id: int, worker_id: str, ttl_ms: float) -> Credit:
        """A credit on a free slot of `worker_id`, its slot held in the registry (not sent yet)."""
        record = self._registry.get(worker_id)
        assert record is not None
        credit = Credit(
            credit_id=f"c{next(self._ids)}",
            session_id=session_id,
            model_id=model_id,
            worker_id=worker_id,
            data_endpoint=record.hello.data_endpoint,
            generation=record.slots[model_id].generation,
            request_ttl_ms=ttl_ms,
        )
        self._credits[credit.credit_id] = credit
        self._by_model.setdefault(model_id, set()).add(credit.credit_id)
        self._registry.acquire(worker_id, credit.slot_key, model_id)
        return credit

    def accepts(self, session_id: int) -> bool:
        return session_id in self._accepting

    def holds_share(self, session_id: int, model_id: str) -> bool:
        """The session holds a credit for the model (not revoked): it queues the model's calls."""
        return any(
            (c := self._credits[i]).session_id == session_id and not c.revoked
            for i in self._by_model.get(model_id, ())
        )

    def reclaim(self, model_id: str, slots: int) -> None:
        """Requests wait here for `slots` slots of a model whose slots are lent with local
        queues: revoke a credit for each slot no revocation under way will free, from the
        session most over its share (an idle-looking credit first). No pause."""
        credits = [self._credits[i] for i in self._by_model.get(model_id, ())]
        need = slots - sum(c.revoked for c in credits)
        live = [c for c in credits if not c.revoked]
        targets = self._targets.get(model_id, {})
        while need > 0 and live:
            held = Counter(c.session_id for c in live)
            victim = max(held, key=lambda s: (held[s] - targets.get(s, 0), held[s], -s))
            credit = min((c for c in live if c.session_id == victim), key=_idle_first)
            live.remove(credit)
            self._revoke([credit])
            need -= 1

    def next_rebalance(self) -> float | None:
        """When the next split model is due to be measured again (None: none is split)."""
        return min(self._split.values()) + self._period_s if self._split else None

    def rebalance(self, now: float) -> set[str]:
        """Measure the due split models again: revoke what a session holds over its new share
        (the freed slots are lent to those under theirs when they come back). A model left with
        one borrower is whole again: other sessions' credits are revoked. Returns the models
        it touched."""
        touched: set[str] = set()
        for model_id in [m for m, since in self._split.items() if since + self._period_s <= now]:
            touched.add(model_id)
            borrowers = self.borrowers(model_id, now)
            if len(borrowers) > 1:
                targets = self._plan(model_id, borrowers, now)
            else:
                for table in (self._split, self._demand_s, self._targets):
                    table.pop(model_id, None)
                targets = dict.fromkeys(borrowers, len(self._by_model.get(model_id, ())))
            live = [self._credits[i] for i in self._by_model.get(model_id, ())]
            live = [c for c in live if not c.revoked]
            held = Counter(c.session_id for c in live)
            for credit in sorted(live, key=_idle_first):
                if held[credit.session_id] > targets.get(credit.session_id, 0):
                    held[credit.session_id] -= 1
                    self._revoke([credit])
        return touched

    def _plan(self, model_id: str, borrowers: list[int], now: float) -> dict[int, int]:
        """Each borrower's share of the model's slots, in proportion to its demand since the
        model was last measured: the calls it had waiting or running on its credits, on average
        (as its gateway reports them), plus its requests waiting here (equal shares when none
        has any). While there are enough slots each borrower keeps at least one, so a gateway
        with sparse (priority-0) calls runs them at once instead of reclaiming a slot for each
        (docs/data-path.md measures both). Starts the next measurement period."""
        since = self._split.get(model_id)
        reported = self._demand_s.get(model_id, {})
        elapsed_s = max(now - since, 1e-3) if since is not None else math.inf
        central = self._central(model_id)
        demand = {s: reported.get(s, 0.0) / elapsed_s + central.get(s, 0) for s in borrowers}
        total = sum(demand.values())
        if total <= 0.0:
            demand, total = dict.fromkeys(borrowers, 1.0), float(len(borrowers))
        slots = self._registry.inflight(model_id)
        quotas = {s: slots * d / total for s, d in demand.items()}
        targets = {s: math.floor(q) for s, q in quotas.items()}
        spare = slots - sum(targets.values())  # to the largest remainders
        for s in sorted(quotas, key=lambda s: (targets[s] - quotas[s], s))[:spare]:
            targets[s] += 1
        if slots >= len(targets):  # every borrower keeps a slot, taken from the largest part
            for s in [s for s, n in targets.items() if n == 0]:
                targets[max(targets, key=lambda t: (targets[t], -t))] -= 1
                targets[s] = 1
        self._split[model_id] = now
        self._demand_s[model_id] = {}
        self._targets[model_id] = targets
        return targets

    def _held(self, model_id: str) -> Counter[int]:
        """Credits for the model each session holds, not revoked."""
        return Counter(
            c.session_id for i in self._by_model.get(model_id, ()) if not (c := self._credits[i]).revoked
        )

    def _neediest(self, model_id: str, targets: Mapping[int, int], held: Counter[int]) -> int:
        """The session a freed slot goes to: furthest under its share, then most waiting."""
        depths = self._local_depths.get(model_id, {})
        return max(targets, key=lambda s: (targets[s] - held[s], depths.get(s, 0), -s))

    def revoke_model(self, model_id: str) -> None:
        """Take back every credit for the model (it may no longer be lent: a worker joined
        past the cap)."""
        self._revoke(self._credits[i] for i in self._by_model.get(model_id, ()))

    def revoke_stale(self, worker_id: str, slots: Iterable[SlotStatus]) -> None:
        """Revoke the worker's credits for models it no longer holds READY at the lent generation."""
        if not self._credits:
            return
        ready = {slot.model_id: slot.generation for slot in slots if slot.state is SlotState.READY}
        self._revoke(
            c
            for c in self._credits.values()
            if c.worker_id == worker_id and ready.get(c.model_id) != c.generation
        )

    def revoke_all(self) -> None:
        self._revoke(self._credits.values())

    def give_back(self, session_id: int, credit_id: str) -> Credit | None:
        """The gateway returned a credit: free its slot. A run still on it keeps a slot of its
        own in the registry (the caller stops treating it as a credit run)."""
        credit = self._credits.get(credit_id)
        if credit is None or credit.session_id != session_id:
            return None
        self._forget(credit)
        for key in credit.running:
            self._registry.acquire(credit.worker_id, key, credit.model_id)
        self._registry.release(credit.worker_id, credit.slot_key)
        return credit

    def drop_session(self, session_id: int) -> set[str]:
        """The session ended: free its credits' slots, forget its use of models; returns the
        models whose slots were freed."""
        self._accepting.discard(session_id)
        for users in self._users.values():
            users.pop(session_id, None)
        for by_session in (self._local_depths, self._demand_s, self._targets):
            for table in by_session.values():
                table.pop(session_id, None)
        freed: set[str] = set()
        for credit in [c for c in self._credits.values() if c.session_id == session_id]:
            self._forget(credit)
            self._registry.release(credit.worker_id, credit.slot_key)
            freed.add(credit.model_id)
        return freed

    def drop_worker(self, worker_id: str) -> list[RequestKey]:
        """The worker is gone (its registry record with it): forget its credits, tell their
        gateways; returns the runs that were on them."""
        running: list[RequestKey] = []
        for credit in [c for c in self._credits.values() if c.worker_id == worker_id]:
            self._forget(credit)
            if not credit.revoked:
                self._out.revoke_credit(credit.session_id, credit.credit_id)
            running.extend(credit.running)
        return running

    def _forget(self, credit: Credit) -> None:
        del self._credits[credit.credit_id]
        ids = self._by_model[credit.model_id]
        ids.discard(credit.credit_id)
        if not ids:
            del self._by_model[credit.model_id]

    def _revoke(self, credits: Iterable[Credit]) -> None:
        for credit in [c for c in credits if not c.revoked]:
            credit.revoked = True
            self._out.revoke_credit(credit.session_id, credit.credit_id)
            self._telemetry.record("credits_revoked", 1, {"model": credit.model_id})
