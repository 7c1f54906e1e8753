"""Protobuf <-> domain translation."""

from __future__ import annotations

from loadmaster.common.ordering import DeadlineTerms
from loadmaster.scheduler import wire
from loadmaster.scheduler.domain import (
    Completion,
    Credit,
    CreditRevoke,
    CreditRun,
    FinishedRun,
    Grant,
    LoadModel,
    LocalQueueSpec,
    QueueStats,
    Reject,
    RequestInfo,
    SlotState,
    UnloadModel,
    WorkerView,
)
from loadmaster.v1 import errors_pb2, model_pool_pb2, scheduler_pb2


def test_submission_translates_every_kind() -> None:
    pb = scheduler_pb2.SessionRequest(
        enqueue=[
            scheduler_pb2.RequestInfo(
                request_id="r1",
                model_id="m",
                client_id="c",
                priority=2,
                urgency=0.5,
                timeout_ms=20,
                steps_remaining=3,
            ),
            scheduler_pb2.RequestInfo(request_id="r2", model_id="m"),
            scheduler_pb2.RequestInfo(request_id="r3", model_id="m", credit_id="c7"),
        ],
        complete=[
            scheduler_pb2.Complete(
                request_id="r0", error_code=errors_pb2.ERROR_CODE_UNAVAILABLE, retryable=True, worker_id="w"
            )
        ],
        cancel=["r9"],
        return_credit=["c5"],
        finished_run=[
            scheduler_pb2.FinishedRun(
                request=scheduler_pb2.RequestInfo(request_id="r4", model_id="m", credit_id="c7"),
                complete=scheduler_pb2.Complete(request_id="r4", worker_id="w", inference_ms=1.5),
            )
        ],
    )
    batch = wire.submission(pb)
    assert batch.finished == [
        FinishedRun(
            CreditRun("c7", RequestInfo("r4", "m")), Completion("r4", worker_id="w", inference_ms=1.5)
        )
    ]
    enqueues, completes, cancels = batch.enqueues, batch.completes, batch.cancels
    assert batch.runs == [CreditRun("c7", RequestInfo("r3", "m"))]
    assert batch.returns == ["c5"]
    assert enqueues == [
        RequestInfo("r1", "m", client_id="c", priority=2, urgency=0.5, timeout_ms=20.0, steps_remaining=3),
        RequestInfo("r2", "m"),
    ]
    assert completes == [Completion("r0", errors_pb2.ERROR_CODE_UNAVAILABLE, True, "w")]
    assert cancels == ["r9"]


def test_session_response_carries_grants_and_rejects() -> None:
    response = wire.session_response(
        [Grant("r1", "w", "tcp://w", 4, 123, 2), Reject("r2", errors_pb2.ERROR_CODE_EXPIRED, "late")]
    )
    assert response.grants[0] == scheduler_pb2.Grant(
        request_id="r1", worker_id="w", data_endpoint="tcp://w", generation=4, deadline_unix_ns=123, attempt=2
    )
    assert response.rejects[0] == scheduler_pb2.Reject(
        request_id="r2", error_code=errors_pb2.ERROR_CODE_EXPIRED, message="late"
    )


def test_session_response_carries_credits_and_revocations() -> None:
    credit = Credit("c1", 3, "m", "w", "tcp://w", 2, 250.0)
    response = wire.session_response([credit, CreditRevoke("c0")])
    assert response.credits[0] == scheduler_pb2.Credit(
        credit_id="c1",
        model_id="m",
        worker_id="w",
        data_endpoint="tcp://w",
        generation=2,
        request_ttl_ms=250.0,
    )
    assert list(response.revokes) == ["c0"]


def test_a_credits_local_queue_spec_carries_tiered_deadlines_tiers_and_the_stage() -> None:
    spec = LocalQueueSpec(
        strategy="tiered_deadline",
        terms=DeadlineTerms(priority_step_ms=50.0),
        latency_budget_ms=40.0,
        client_latency_budget_ms={"robot": 10.0},
        cadence_alpha=0.3,
        max_queue_size=64,
        reject_newest=True,
        tiers=(0, 2),
        stage=2,
    )
    credit = Credit("c1", 3, "m", "w", "tcp://w", 2, 250.0, local_queue=spec)
    sent = wire.session_response([credit]).credits[0].local_queue
    assert (sent.strategy, list(sent.tiers), sent.priority_step_ms) == ("tiered_deadline", [0, 2], 50.0)
    assert sent.stage == 2  # calls the gateway stages behind a busy slot's running one
    assert (dict(sent.client_latency_budget_ms), sent.max_queue_size, sent.reject_newest) == (
        {"robot": 10.0},
        64,
        True,
    )


def test_worker_messages_and_admin_round_trip() -> None:
    hello = wire.worker_hello(
        scheduler_pb2.WorkerHello(worker_id="w", data_endpoint="tcp://w", node="n", repository=["a", "b"])
    )
    status = model_pool_pb2.ModelSlotStatus(
        model_id="a",
        state=model_pool_pb2.MODEL_STATE_READY,
        generation=2,
        inflight=1,
        max_inflight=4,
        device="cpu",
        error="",
        pinned=True,
        load_time_ms=1.5,
    )
    [slot] = wire.slot_statuses(scheduler_pb2.WorkerReport(models=[status]))
    assert slot.state is SlotState.READY and slot.generation == 2
    listed = wire.list_workers_response([WorkerView(hello, (slot,))])
    assert listed.workers[0].repository == ["a", "b"]
    assert listed.workers[0].models[0] == status
    assert wire.worker_command(LoadModel("a")).load == "a"
    assert wire.worker_command(UnloadModel("a")).WhichOneof("kind") == "unload"
    queues = wire.get_queues_response([QueueStats("a", 1, 2, 3, 4, 5)], "priority")
    assert queues.strategy == "priority"
    assert queues.queues[0] == scheduler_pb2.QueueInfo(
        model_id="a", depth=1, inflight=2, expired=3, overflowed=4, granted=5
    )


def test_every_model_state_maps_both_ways() -> None:
    for value in model_pool_pb2.ModelState.values():
        [slot] = wire.slot_statuses(
            scheduler_pb2.WorkerReport(models=[model_pool_pb2.ModelSlotStatus(model_id="m", state=value)])
        )
        hello = wire.worker_hello(scheduler_pb2.WorkerHello(worker_id="w"))
        assert wire.list_workers_response([WorkerView(hello, (slot,))]).workers[0].models[0].state == value
