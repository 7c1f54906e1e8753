"""Protobuf <-> domain translation for the Scheduler service, in one place."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeAlias

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.scheduler.domain import (
    Completion,
    Credit,
    CreditRevoke,
    CreditRun,
    FinishedRun,
    Grant,
    LoadModel,
    LocalQueueSpec,
    Outcome,
    Placement,
    QueueStats,
    RemoteService,
    RequestInfo,
    RunTally,
    SlotState,
    SlotStatus,
    Submission,
    UnloadModel,
    WorkerCommand,
    WorkerHello,
    WorkerView,
)
from loadmaster.v1 import model_pool_pb2, scheduler_pb2

__all__ = [
    "SessionOutcome",
    "get_queues_response",
    "list_workers_response",
    "session_response",
    "slot_statuses",
    "submission",
    "worker_command",
    "worker_hello",
]

_STATE_FROM_PB: dict[model_pool_pb2.ModelState.ValueType, SlotState] = {
    model_pool_pb2.MODEL_STATE_UNSPECIFIED: SlotState.UNSPECIFIED,
    model_pool_pb2.MODEL_STATE_IDLE: SlotState.IDLE,
    model_pool_pb2.MODEL_STATE_LOADING: SlotState.LOADING,
    model_pool_pb2.MODEL_STATE_READY: SlotState.READY,
    model_pool_pb2.MODEL_STATE_DRAINING: SlotState.DRAINING,
    model_pool_pb2.MODEL_STATE_UNLOADING: SlotState.UNLOADING,
}
_STATE_TO_PB: dict[SlotState, model_pool_pb2.ModelState.ValueType] = {
    state: value for value, state in _STATE_FROM_PB.items()
}

SessionOutcome: TypeAlias = Outcome | Credit | CreditRevoke | Placement


def _request_info(pb: scheduler_pb2.RequestInfo) -> RequestInfo:
    return RequestInfo(
        request_id=pb.request_id,
        model_id=pb.model_id,
        client_id=pb.client_id,
        priority=pb.priority,
        urgency=pb.urgency,
        timeout_ms=pb.timeout_ms,
        steps_remaining=pb.steps_remaining if pb.HasField("steps_remaining") else None,
        received_unix_ns=pb.received_unix_ns,
        payload_bytes=pb.payload_bytes,
        client_type=pb.client_type,
        trace_context=dict(pb.trace_context) if pb.trace_context else None,
        affinity_key=pb.affinity_key,
        connection_bound=pb.connection_bound,
    )


def submission(pb: scheduler_pb2.SessionRequest) -> Submission:
    enqueues: list[RequestInfo] = []
    runs: list[CreditRun] = []
    for request in pb.enqueue:
        info = _request_info(request)
        if request.credit_id:
            runs.append(CreditRun(request.credit_id, info))
        else:
            enqueues.append(info)
    completes = [_completion(c) for c in pb.complete]
    cancels = list(pb.cancel)
    returns = list(pb.return_credit)
    finished = [
        FinishedRun(CreditRun(f.request.credit_id, _request_info(f.request)), _completion(f.complete))
        for f in pb.finished_run
    ]
    depths = [(d.model_id, d.waiting, d.outstanding_s) for d in pb.local_queue_depth]
    tallies = [RunTally(t.model_id, t.worker_id, t.runs, t.failed, t.inference_ms) for t in pb.run_tally]
    return Submission(enqueues, completes, cancels, runs, returns, finished, depths, tallies)


def _completion(pb: scheduler_pb2.Complete) -> Completion:
    return Completion(
        request_id=pb.request_id,
        error_code=pb.error_code,
        retryable=pb.retryable,
        worker_id=pb.worker_id,
        inference_ms=pb.inference_ms,
    )


def _local_queue(pb: scheduler_pb2.LocalQueue, spec: LocalQueueSpec) -> None:
    terms = spec.terms
    pb.strategy = spec.strategy
    pb.priority_step_ms = terms.priority_step_ms
    pb.urgency_weight = terms.urgency_weight
    pb.steps_horizon = terms.steps_horizon
    pb.service_ms = terms.service_ms
    pb.latency_budget_ms = spec.latency_budget_ms
    pb.client_latency_budget_ms.update(spec.client_latency_budget_ms)
    pb.cadence_alpha = spec.cadence_alpha
    pb.max_queue_size = spec.max_queue_size
    pb.reject_newest = spec.reject_newest
    pb.tiers.extend(spec.tiers)
    pb.stage = spec.stage
    pb.policy = spec.policy


def session_response(outcomes: Iterable[SessionOutcome]) -> scheduler_pb2.SessionResponse:
    response = scheduler_pb2.SessionResponse()
    for outcome in outcomes:
        if isinstance(outcome, Credit):
            response.credits.add(
                credit_id=outcome.credit_id,
                model_id=outcome.model_id,
                worker_id=outcome.worker_id,
                data_endpoint=outcome.data_endpoint,
                generation=outcome.generation,
                request_ttl_ms=outcome.request_ttl_ms,
            )
            if (spec := outcome.local_queue) is not None:
                _local_queue(response.credits[-1].local_queue, spec)
        elif isinstance(outcome, CreditRevoke):
            response.revokes.append(outcome.credit_id)
        elif isinstance(outcome, Placement):
            placement = response.placements.add(model_id=outcome.model_id)
            for placed in outcome.workers:
                placement.workers.add(
                    worker_id=placed.worker_id,
                    data_endpoint=placed.data_endpoint,
                    generation=placed.generation,
                )
        elif isinstance(outcome, Grant):
            response.grants.add(
                request_id=outcome.request_id,
                worker_id=outcome.worker_id,
                data_endpoint=outcome.data_endpoint,
                generation=outcome.generation,
                deadline_unix_ns=outcome.deadline_unix_ns,
                attempt=outcome.attempt,
            )
        else:
            response.rejects.add(
                request_id=outcome.request_id,
                error_code=outcome.error_code,
                message=outcome.message,
                use_share=outcome.use_share,
            )
    return response


def worker_hello(pb: scheduler_pb2.WorkerHello) -> WorkerHello:
    if not pb.worker_id:
        raise InvalidArgumentError("WorkerHello needs worker_id")
    return WorkerHello(
        worker_id=pb.worker_id,
        data_endpoint=pb.data_endpoint,
        grpc_endpoint=pb.grpc_endpoint,
        node=pb.node,
        repository=tuple(pb.repository),
    )


def slot_statuses(pb: scheduler_pb2.WorkerReport) -> list[SlotStatus]:
    return [
        SlotStatus(
            model_id=m.model_id,
            state=_STATE_FROM_PB.get(m.state, SlotState.UNSPECIFIED),
            generation=m.generation,
            inflight=m.inflight,
            max_inflight=m.max_inflight,
            device=m.device,
            vram_mb=m.vram_mb,
            backend=m.backend,
            pinned=m.pinned,
            last_used_unix_ms=m.last_used_unix_ms,
            loaded_unix_ms=m.loaded_unix_ms,
            load_time_ms=m.load_time_ms,
            load_started_unix_ms=m.load_started_unix_ms,
            error=m.error,
            lease_id=m.lease_id,
            priority=m.priority,
        )
        for m in pb.models
    ]


def _slot_pb(slot: SlotStatus) -> model_pool_pb2.ModelSlotStatus:
    return model_pool_pb2.ModelSlotStatus(
        model_id=slot.model_id,
        state=_STATE_TO_PB[slot.state],
        generation=slot.generation,
        inflight=slot.inflight,
        max_inflight=slot.max_inflight,
        device=slot.device,
        vram_mb=slot.vram_mb,
        backend=slot.backend,
        pinned=slot.pinned,
        last_used_unix_ms=slot.last_used_unix_ms,
        loaded_unix_ms=slot.loaded_unix_ms,
        load_time_ms=slot.load_time_ms,
        load_started_unix_ms=slot.load_started_unix_ms,
        error=slot.error,
        lease_id=slot.lease_id,
        priority=slot.priority,
    )


def worker_command(command: WorkerCommand) -> scheduler_pb2.WorkerSessionResponse:
    if isinstance(command, LoadModel):
        return scheduler_pb2.WorkerSessionResponse(load=command.model_id)
    if isinstance(command, RemoteService):
        return scheduler_pb2.WorkerSessionResponse(remote_service=tenant_services_pb(command.models))
    assert isinstance(command, UnloadModel)
    return scheduler_pb2.WorkerSessionResponse(unload=command.model_id)


def tenant_services(pb: scheduler_pb2.TenantServices) -> dict[str, dict[str, float]]:
    return {m.model_id: dict(m.service) for m in pb.models}


def tenant_services_pb(models: dict[str, dict[str, float]]) -> scheduler_pb2.TenantServices:
    return scheduler_pb2.TenantServices(
        models=[scheduler_pb2.TenantService(model_id=m, service=s) for m, s in sorted(models.items())]
    )


def list_workers_response(workers: Sequence[WorkerView]) -> scheduler_pb2.ListWorkersResponse:
    response = scheduler_pb2.ListWorkersResponse()
    for view in workers:
        hello = view.hello
        response.workers.add(
            worker_id=hello.worker_id,
            data_endpoint=hello.data_endpoint,
            grpc_endpoint=hello.grpc_endpoint,
            node=hello.node,
            repository=list(hello.repository),
            models=[_slot_pb(slot) for slot in view.slots],
        )
    return response


def get_queues_response(
    stats: Sequence[QueueStats], strategy: str, *, policy: str = "", active_clients: int = 0
) -> scheduler_pb2.GetQueuesResponse:
    response = scheduler_pb2.GetQueuesResponse(
        strategy=strategy, policy=policy, active_clients=active_clients
    )
    for q in stats:
        response.queues.add(
            model_id=q.model_id,
            depth=q.depth,
            inflight=q.inflight,
            expired=q.expired,
            overflowed=q.overflowed,
            granted=q.granted,
            superseded=q.superseded,
            dropped=q.dropped,
            credits=q.credits,
        )
    return response
