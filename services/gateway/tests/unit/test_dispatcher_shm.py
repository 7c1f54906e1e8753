"""Which payloads the dispatcher sends through shared memory, and when each slot is given back.

The region is a real `ShmArena` in a temporary directory; the scheduler and worker links
are in-module doubles (the real path is covered by tests/e2e/test_gateway_shm.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.common.errors import UnavailableError
from loadmaster.common.gateway_config import SharedMemorySettings
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.gateway.calls import CallResult, InferenceCall
from loadmaster.gateway.dispatcher import Dispatcher
from loadmaster.gateway.worker_link import ShmPayloads, is_local_endpoint
from loadmaster.v1 import errors_pb2, model_pool_pb2, scheduler_pb2

LOCAL = "tcp://127.0.0.1:5556"
LARGE = bytes(range(256)) * 400  # 100 KiB


class _Scheduler:
    connected = True
    session = 1

    def __init__(self) -> None:
        self.completed: list[tuple[str, int, bool]] = []

    def enqueue(self, request: scheduler_pb2.RequestInfo) -> None:
        pass

    def complete(self, request_id: str, *, error_code: int = 0, retryable: bool = False, **_: Any) -> None:
        self.completed.append((request_id, error_code, retryable))

    def cancel(self, request_id: str) -> None:
        pass


class _Workers:
    def __init__(self) -> None:
        self.sent: list[tuple[str, model_pool_pb2.InferRequest, bytes]] = []
        self.refuse = False

    def send(self, endpoint: str, envelope: bytes, payload: Any) -> None:
        if self.refuse:
            raise UnavailableError(f"{endpoint} refused")
        self.sent.append((endpoint, model_pool_pb2.InferRequest.FromString(envelope), bytes(payload)))


@dataclass
class Parts:
    dispatcher: Dispatcher
    scheduler: _Scheduler
    workers: _Workers
    shm: ShmPayloads
    results: list[CallResult]
    clock: FakeClock

    def submit(self, request_id: str = "r1", payload: bytes = LARGE) -> None:
        call = InferenceCall(request_id=request_id, client_id="c", model_id="m", inputs=[], payload=payload)
        self.dispatcher.submit(call, self.results.append)

    def grant(
        self, request_id: str = "r1", worker: str = "w1", endpoint: str = LOCAL, attempt: int = 1
    ) -> None:
        self.dispatcher.on_grant(
            scheduler_pb2.Grant(
                request_id=request_id, worker_id=worker, data_endpoint=endpoint, attempt=attempt
            )
        )

    def reply(self, request_id: str = "r1", worker: str = "w1", **fields: Any) -> None:
        reply = model_pool_pb2.InferResponse(request_id=request_id, model_id="m", worker_id=worker, **fields)
        self.dispatcher.on_worker_reply(reply, b"out")

    @property
    def allocated(self) -> int:
        return self.shm.arena.slots.allocated_bytes if self.shm.arena is not None else 0

    @property
    def quarantined(self) -> int:
        return self.shm.arena.slots.quarantined if self.shm.arena is not None else 0


def make_parts(tmp_path: Path, **settings: Any) -> Parts:
    shm = ShmPayloads(SharedMemorySettings(**settings), directory=tmp_path)
    scheduler, workers, clock = _Scheduler(), _Workers(), FakeClock()
    dispatcher = Dispatcher(
        scheduler=lambda _: scheduler,
        workers=lambda _: workers,
        telemetry=TelemetryReporter("gateway", "test", None),
        shm=shm,
        clock=clock,
        reply_grace_s=10.0,
    )
    return Parts(dispatcher, scheduler, workers, shm, [], clock)


@pytest.fixture
async def parts(tmp_path: Path) -> AsyncIterator[Parts]:
    made = make_parts(tmp_path)
    made.dispatcher.start()
    yield made
    await made.dispatcher.close()
    made.shm.close()
    assert list(tmp_path.iterdir()) == []  # the region is unlinked


async def test_a_large_payload_for_a_local_worker_goes_through_shm_and_is_freed_by_the_reply(
    parts: Parts,
) -> None:
    parts.submit()
    parts.grant()
    ((_, request, frame),) = parts.workers.sent
    assert frame == b""  # nothing on the socket
    assert request.shm.region == parts.shm.region and request.shm.size == len(LARGE)
    arena = parts.shm.arena
    assert arena is not None and arena.path.read_bytes()[request.shm.offset :][: len(LARGE)] == LARGE
    assert parts.allocated > 0
    parts.reply()
    assert parts.results[0].ok and parts.allocated == 0 and parts.quarantined == 0


@pytest.mark.parametrize(
    ("endpoint", "payload", "settings"),
    [
        (LOCAL, LARGE[: (64 << 10) - 1], {}),  # below the threshold
        ("tcp://model-pool-1:5556", LARGE, {}),  # a host name: maybe another host
        ("tcp://10.0.0.7:5556", LARGE, {}),
        (LOCAL, LARGE, {"enabled": False}),
        (LOCAL, LARGE, {"min_payload_bytes": len(LARGE) + 1}),
    ],
)
async def test_other_payloads_go_on_the_socket(
    tmp_path: Path, endpoint: str, payload: bytes, settings: dict[str, Any]
) -> None:
    parts = make_parts(tmp_path, **settings)
    parts.submit(payload=payload)
    parts.grant(endpoint=endpoint)
    ((_, request, frame),) = parts.workers.sent
    assert not request.HasField("shm") and frame == payload
    assert parts.shm.arena is None and list(tmp_path.iterdir()) == []  # no region was even created


def test_local_endpoints() -> None:
    local = [
        "ipc:///tmp/worker.sock",
        "tcp://127.0.0.1:1",
        "tcp://127.8.0.1:1",
        "tcp://[::1]:1",
        "tcp://localhost:1",
    ]
    remote = ["tcp://worker:1", "tcp://10.1.2.3:1", "tcp://0.0.0.0:1", "inproc://x", "tcp://[fe80::1]:1"]
    assert all(is_local_endpoint(e) for e in local)
    assert not any(is_local_endpoint(e) for e in remote)


async def test_a_full_region_sends_the_payload_on_the_socket(tmp_path: Path) -> None:
    parts = make_parts(tmp_path, region_mb=1)
    image = bytes(900_000)
    parts.submit("a", image)
    parts.submit("b", image)
    parts.grant("a")
    parts.grant("b")
    (_, first, first_frame), (_, second, second_frame) = parts.workers.sent
    assert first.HasField("shm") and first_frame == b""
    assert not second.HasField("shm") and second_frame == image
    parts.reply("a")
    parts.reply("b")
    assert [r.ok for r in parts.results] == [True, True] and parts.allocated == 0
    parts.shm.close()


async def test_a_worker_that_never_replies_leaves_its_slot_in_quarantine(parts: Parts) -> None:
    parts.submit()
    parts.grant()
    parts.clock.advance(10.5)  # the watchdog (reply_grace_s=10) answers `expired`
    for _ in range(3):
        await asyncio.sleep(0)
    assert parts.results[0].error is not None and parts.results[0].error.edge_code == "expired"
    assert parts.quarantined == 1 and parts.allocated > 0
    parts.reply()  # too late: ignored, the slot stays in quarantine
    assert parts.quarantined == 1


async def test_cancel_while_the_worker_runs_quarantines_the_slot(parts: Parts) -> None:
    parts.submit()
    parts.grant()
    parts.dispatcher.cancel("r1")
    assert parts.quarantined == 1


async def test_a_second_grant_quarantines_the_first_grants_slot(parts: Parts) -> None:
    parts.submit()
    parts.grant(worker="w1")
    parts.grant(worker="w2", attempt=2)  # the scheduler gave up on w1
    first, second = (sent[1].shm for sent in parts.workers.sent)
    assert parts.quarantined == 1 and first.offset != second.offset
    parts.reply(worker="w2")
    assert parts.results[0].ok and parts.quarantined == 1  # w2's slot freed, w1's kept aside


async def test_a_retryable_reply_frees_the_slot_and_a_regrant_places_it_again(parts: Parts) -> None:
    parts.submit()
    parts.grant()
    parts.reply(error_code=errors_pb2.ERROR_CODE_UNAVAILABLE, retryable=True)
    assert parts.allocated == 0 and parts.scheduler.completed[-1][2]
    parts.grant(attempt=2)
    assert parts.workers.sent[-1][1].HasField("shm") and parts.allocated > 0


async def test_a_worker_that_cannot_map_the_region_gets_payloads_on_the_socket(
    parts: Parts, caplog: pytest.LogCaptureFixture
) -> None:
    unusable = {"error_code": errors_pb2.ERROR_CODE_UNAVAILABLE, "retryable": True, "shm_unusable": True}
    with caplog.at_level(logging.WARNING, logger="loadmaster.gateway.worker_link"):
        parts.submit()
        parts.grant()
        parts.reply(error_message="region cannot be opened here", **unusable)
        assert parts.results == [] and parts.scheduler.completed == [
            ("r1", errors_pb2.ERROR_CODE_UNAVAILABLE, True)
        ]
        parts.grant(attempt=2)  # the retry goes on the socket
        _, retry, frame = parts.workers.sent[-1]
        assert not retry.HasField("shm") and frame == LARGE
        parts.reply(**unusable)  # said again (a request sent before the first refusal): logged once
    assert parts.allocated == 0
    assert sum("cannot read shared memory" in r.message for r in caplog.records) == 1


async def test_a_send_that_fails_frees_its_slot(parts: Parts) -> None:
    parts.workers.refuse = True
    parts.submit()
    parts.grant()
    assert parts.scheduler.completed == [("r1", errors_pb2.ERROR_CODE_UNAVAILABLE, True)]
    assert parts.allocated == 0 and parts.quarantined == 0


async def test_without_room_for_a_region_shm_turns_off(tmp_path: Path) -> None:
    parts = make_parts(tmp_path / "missing")  # the directory does not exist: no region
    parts.submit()
    parts.grant()
    ((_, request, frame),) = parts.workers.sent
    assert not request.HasField("shm") and frame == LARGE


def test_the_region_can_be_reserved_before_the_first_payload(tmp_path: Path) -> None:
    """Made on the first large payload, the region cost that request's event-loop turn ~100 ms
    (created and populated there); the gateway reserves it at start, off the loop."""
    shm = ShmPayloads(SharedMemorySettings(region_mb=1), directory=tmp_path)
    shm.reserve()
    region = shm.region
    assert region and (tmp_path / region).stat().st_size == 1 << 20
    shm.reserve()  # once only
    assert shm.region == region
    off = ShmPayloads(SharedMemorySettings(enabled=False), directory=tmp_path)
    off.reserve()
    assert off.region == "" and sorted(p.name for p in tmp_path.iterdir()) == [region]
    shm.close()
    assert not any(tmp_path.iterdir())
