"""The worker's session to the scheduler: hello, reports, commands, reconnects."""

from __future__ import annotations

import asyncio
import gc
import socket
import time
import types
from pathlib import Path
from typing import Any

from loadmaster.model_pool.server import ModelPoolServer
from loadmaster.model_pool.worker_session import WorkerSession
from loadmaster.v1 import model_pool_pb2, scheduler_pb2

READY = model_pool_pb2.MODEL_STATE_READY
IDLE = model_pool_pb2.MODEL_STATE_IDLE


def states(message: scheduler_pb2.WorkerSessionRequest) -> dict[str, int]:
    if message.WhichOneof("kind") != "report":
        return {}
    return {m.model_id: m.state for m in message.report.models}


def _open_streams() -> list[Any]:
    """The worker sessions' message streams (async generators) that have not ended."""
    code = WorkerSession._messages.__code__
    return [
        g
        for g in gc.get_objects()
        if type(g) is types.AsyncGeneratorType and g.ag_code is code and g.ag_frame is not None
    ]


def is_hello(message: scheduler_pb2.WorkerSessionRequest) -> bool:
    return message.WhichOneof("kind") == "hello"


async def test_hello_then_reports(worker: ModelPoolServer, scheduler: Any) -> None:
    fake, _ = scheduler
    hello = (await fake.wait_for(is_hello)).hello
    assert hello.worker_id == "worker-test"
    assert hello.data_endpoint == worker.data_endpoint
    assert hello.grpc_endpoint == worker.grpc_endpoint
    assert hello.node == "local"
    assert {"classifier", "double", "policy", "policy-onnx", "sleep"} <= set(hello.repository)
    assert fake.messages.index(next(m for m in fake.messages if is_hello(m))) == 0
    report = await fake.wait_for(
        lambda m: all(states(m).get(x) == READY for x in ("double", "sleep", "policy"))
    )
    by_id = {m.model_id: m for m in report.report.models}
    assert (
        by_id["double"].lease_id and by_id["double"].generation == 1 and by_id["double"].backend == "python"
    )
    assert by_id["classifier"].state == IDLE


async def test_commands_are_obeyed_and_reported(worker: ModelPoolServer, scheduler: Any) -> None:
    fake, _ = scheduler
    await fake.wait_for(lambda m: states(m).get("policy") == READY)
    mark = len(fake.messages)
    fake.command(scheduler_pb2.WorkerSessionResponse(unload="policy"))
    await fake.wait_for(lambda m: states(m).get("policy") == IDLE, after=mark)
    mark = len(fake.messages)
    fake.command(scheduler_pb2.WorkerSessionResponse(load="policy"))
    report = await fake.wait_for(lambda m: states(m).get("policy") == READY, after=mark)
    assert {m.model_id: m.generation for m in report.report.models}["policy"] == 2
    # A load that fails (no artifact generated for the classifier here) is reported with its error.
    mark = len(fake.messages)
    fake.command(scheduler_pb2.WorkerSessionResponse(load="classifier"))
    report = await fake.wait_for(
        lambda m: any(x.model_id == "classifier" and x.error for x in m.report.models), after=mark
    )
    classifier = next(x for x in report.report.models if x.model_id == "classifier")
    assert classifier.state == IDLE and "make models" in classifier.error
    fake.command(scheduler_pb2.WorkerSessionResponse(load="no-such-model"))
    mark = len(fake.messages)
    fake.command(scheduler_pb2.WorkerSessionResponse(unload="double"))
    await fake.wait_for(lambda m: states(m).get("double") == IDLE, after=mark)  # still obeying
    assert fake.sessions == 1


async def test_reconnects_after_the_stream_drops(worker: ModelPoolServer, scheduler: Any) -> None:
    fake, _ = scheduler
    await fake.wait_for(lambda m: states(m).get("policy") == READY)
    mark = len(fake.messages)
    fake.drop()
    await fake.wait_for(is_hello, after=mark)
    report = await fake.wait_for(lambda m: states(m).get("policy") == READY, after=mark)
    assert report is not None and fake.sessions == 2


async def test_scheduler_may_start_after_the_worker(
    example_repo: Path, leases: Any, start_worker: Any, scheduler_at: Any
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"
    async with (
        start_worker(example_repo, preload=["double"], lease_client=leases, scheduler_address=address),
        scheduler_at(address) as (fake, _),
    ):
        hello = (await fake.wait_for(is_hello)).hello
        assert hello.worker_id == "worker-test"
        await fake.wait_for(lambda m: states(m).get("double") == READY)


async def test_changes_after_several_reconnects_reach_the_newest_session(
    worker: ModelPoolServer, scheduler: Any
) -> None:
    """A dropped session's message stream must not live on and take the changes meant for the
    next one (found by bench/worker_freeze.py: after three freezes, a model loaded on the worker
    never showed READY at the scheduler)."""
    fake, _ = scheduler
    await fake.wait_for(lambda m: states(m).get("policy") == READY)
    for dropped in range(1, 4):
        mark = len(fake.messages)
        fake.drop()
        await fake.wait_for(is_hello, after=mark)
        await fake.wait_for(lambda m: states(m).get("policy") == READY, after=mark)
        assert fake.sessions == dropped + 1
    # grpc.aio reads a request iterator on after its call ended: each stale stream must end.
    deadline = time.monotonic() + 5
    while len(_open_streams()) > 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert len(_open_streams()) == 1
    for _ in range(3):  # each change once: a stale stream that took one would leave it unheard
        mark = len(fake.messages)
        fake.command(scheduler_pb2.WorkerSessionResponse(unload="policy"))
        await fake.wait_for(lambda m: states(m).get("policy") == IDLE, after=mark, timeout_s=5)
        mark = len(fake.messages)
        fake.command(scheduler_pb2.WorkerSessionResponse(load="policy"))
        await fake.wait_for(lambda m: states(m).get("policy") == READY, after=mark, timeout_s=5)
