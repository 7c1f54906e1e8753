"""Dispatch credits: worker slots lent to a gateway, so its requests skip the scheduler.

The uncontended path should not pay a scheduler round trip per request. So while a model
has no waiters here and one gateway session is its only user within `window_s`, the core
lends that session free slots of workers holding the model READY. The gateway sends a
request on an idle credit straight to the credit's worker and reports it afterwards (a
`CreditRun`, batched with others); the scheduler tracks it like a granted request.

How many: with a per-model strategy a gateway can replicate (`local_queue_spec`), the
session gets *every* free slot (its share is the whole model) and a `LocalQueueSpec`: it
queues its own requests that find no idle credit and ranks them with the same strategy
code (loadmaster.common.ordering), so the scheduler sees no queue for the model and the
order is the one it would have kept (docs/data-path.md). With any other strategy (one
global order, batch groups, a registered policy), at most `dispatch_credits` are lent and
a request finding none idle is queued here, as before.

The moment a request has to wait in the model's queue here (another gateway's, or one
that found no credit), every credit for the model is revoked and lending pauses for
`window_s`, so ordering is central again under contention between gateways. A gateway
whose credits for a model are all revoked hands its locally queued requests to the
scheduler in their local order.

A lent slot counts against the worker's `max_inflight` until the gateway returns the
credit (at once when it is idle, else when the request running on it ends), so a
revocation never lets a worker be granted more than it may run.
`CreditBook` keeps the credits, holds their slots in the worker registry and sends
credits and revocations out; the core decides when to lend and revoke.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from loadmaster.common.ordering import DeadlineTerms, Ordering, Scope
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

__all__ = ["CreditBook", "local_queue_spec", "too_long_for_local"]

# Strategies whose order a gateway can keep for one model's requests on its own: per-model
# scope, no batch groups, no registered policy (a policy module is loaded by the scheduler only).
_LOCAL_STRATEGIES = frozenset({"model_deadline", "priority_tiered", "round_robin", "priority"})


def too_long_for_local(policy: ModelPolicy, config: CoreConfig, inference_s: float | None) -> bool:
    """The model's requests (`inference_s`, measured; None unmeasured) are long enough that the
    lookahead and reservations, which only the scheduler runs, win back more than its round
    trip costs (a model with both turned off never is)."""
    return bool(policy.lookahead or policy.reservation) and (
        inference_s is None or inference_s * 1000.0 > config.local_queue_max_inference_ms
    )


def local_queue_spec(
    ordering: Ordering, policy: ModelPolicy, config: CoreConfig, inference_s: float | None
) -> LocalQueueSpec | None:
    """How a gateway holding the model's whole share may queue for it, or None when it may not:
    another strategy, a model whose queue supersedes (`latest_only`), or one whose requests are
    long enough (`inference_s`, measured; None unmeasured) that the lookahead and reservations,
    which only the scheduler runs, win back more than its round trip costs."""
    if too_long_for_local(policy, config, inference_s):
        return None
    if (
        ordering.name not in _LOCAL_STRATEGIES
        or ordering.scope is not Scope.MODEL
        or ordering.batch is not None
        or bool(getattr(ordering, "policy_name", ""))
        or policy.latest_only
    ):
        return None
    return LocalQueueSpec(
        strategy=ordering.name,
        terms=getattr(ordering, "terms", None) or DeadlineTerms(),
        latency_budget_ms=config.default_latency_budget_ms,
        client_latency_budget_ms=config.client_latency_budgets_ms,
        cadence_alpha=config.cadence_alpha,
        max_queue_size=policy.max_queue_size,
        reject_newest=policy.overflow_policy is OverflowPolicy.REJECT_NEWEST,
    )


class CreditBook:
    def __init__(
        self, window_s: float, *, registry: WorkerRegistry, outbound: Outbound, telemetry: Telemetry
    ) -> None:
        self._window_s = window_s
        self._registry = registry
        self._out = outbound
        self._telemetry = telemetry
        self._credits: dict[str, Credit] = {}
        self._by_model: dict[str, set[str]] = {}
        self._ids = itertools.count(1)
        self._users: dict[str, dict[int, float]] = {}  # model -> session -> last use (monotonic)
        self._paused_until: dict[str, float] = {}
        self._accepting: set[int] = set()
        self._local_depths: dict[str, dict[int, int]] = {}  # model -> session -> waiting there

    def __len__(self) -> int:
        return len(self._credits)

    def get(self, credit_id: str) -> Credit | None:
        return self._credits.get(credit_id)

    def idle(self, model_id: str) -> int:
        """Credits for the model with nothing running on them."""
        return sum(1 for i in self._by_model.get(model_id, ()) if self._credits[i].running is None)

    def lent(self, model_id: str) -> int:
        """Credits for the model not returned yet (revoked ones included)."""
        ids = self._by_model.get(model_id)
        return len(ids) if ids else 0

    def note_local_depth(self, session_id: int, model_id: str, waiting: int) -> None:
        """The session's gateway reports how many requests wait in its local queue."""
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

    def sole_user(self, model_id: str, now: float) -> int | None:
        """The session to lend the model's slots to: the only one that used the model within
        the window, if it accepts credits and lending is not paused."""
        if self._paused_until.get(model_id, 0.0) > now:
            return None
        users = self._users.get(model_id)
        if not users:
            return None
        horizon = now - self._window_s
        if len(users) > 1:
            for session_id in [s for s, last in users.items() if last < horizon]:
                del users[session_id]
        if len(users) != 1:
            return None
        session_id = next(iter(users))
        return session_id if session_id in self._accepting else None

    # ---- lending and taking back -----------------------------------------------

    def lend(
        self,
        model_id: str,
        now: float,
        *,
        limit: int,
        ttl_ms: float,
        pick: Callable[[], str | None],
        local_queue: Callable[[], LocalQueueSpec | None] = lambda: None,
    ) -> None:
        """Lend the model's free slots (`pick` names a worker with one, or None) to its only
        recent gateway, until `limit` credits for it are out.

        A gateway may queue locally (the credits carry `local_queue`'s spec) only while it holds
        every slot of the model: else its queued requests would wait while a slot it was not
        lent stays idle. So when `limit` leaves free slots unlent, the new credits carry no spec,
        and credits that carried one are revoked (the gateway hands its queue to the scheduler)."""
        session_id = self.sole_user(model_id, now)
        if session_id is None:
            return
        lent: list[Credit] = []
        while self.lent(model_id) < limit and (worker_id := pick()) is not None:
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
            lent.append(credit)
        spec = local_queue() if pick() is None else None  # a whole share, or none to queue on
        if spec is None and any(self._credits[i].local_queue for i in self._by_model.get(model_id, ())):
            for credit in lent:  # never sent: take them back unseen
                self._forget(credit)
                self._registry.release(credit.worker_id, credit.slot_key)
            self.revoke_model(model_id, now)
            return
        for credit in lent:
            credit.local_queue = spec
            self._out.lend_credit(session_id, credit)
            self._telemetry.record("credits_lent", 1, {"model": model_id})

    def holds_share(self, session_id: int, model_id: str) -> bool:
        """The session holds credits for the model that let it queue locally (none revoked)."""
        ids = self._by_model.get(model_id)
        if not ids:
            return False
        credits = [self._credits[i] for i in ids]
        return all(c.session_id == session_id and not c.revoked for c in credits) and any(
            c.local_queue is not None for c in credits
        )

    def queue_locally(self, model_id: str) -> bool:
        """A credit out for the model lets its gateway queue locally."""
        return any(self._credits[i].local_queue is not None for i in self._by_model.get(model_id, ()))

    def revoke_model(self, model_id: str, now: float) -> None:
        """A request waits for the model: revoke its credits and pause lending it."""
        ids = self._by_model.get(model_id)
        if ids:
            self._paused_until[model_id] = now + self._window_s
            self._revoke(self._credits[i] for i in ids)

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
        if credit.running is not None:
            self._registry.acquire(credit.worker_id, credit.running, credit.model_id)
        self._registry.release(credit.worker_id, credit.slot_key)
        return credit

    def drop_session(self, session_id: int) -> set[str]:
        """The session ended: free its credits' slots, forget its use of models; returns the
        models whose slots were freed."""
        self._accepting.discard(session_id)
        for users in self._users.values():
            users.pop(session_id, None)
        for depths in self._local_depths.values():
            depths.pop(session_id, None)
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
            if credit.running is not None:
                running.append(credit.running)
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
