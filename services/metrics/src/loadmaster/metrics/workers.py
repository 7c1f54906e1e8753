"""The scheduler's view of workers and their model slots, for the dashboard (`ListWorkers`).

A thin I/O wrapper: one channel, a short deadline, a brief cache so several open
dashboards cost one call a second; `None` when the scheduler cannot be reached (the
dashboard then falls back to the model-pool's `slot_state` samples).
"""

from __future__ import annotations

import logging

import grpc

from loadmaster.common.clock import Clock
from loadmaster.common.grpc_client import aio_channel
from loadmaster.common.retry import retry_options
from loadmaster.metrics.dashboard import SlotRow, WorkerRow
from loadmaster.v1 import model_pool_pb2, scheduler_pb2, scheduler_pb2_grpc

__all__ = ["SchedulerWorkers"]

log = logging.getLogger(__name__)


def _state_name(state: int) -> str:
    return model_pool_pb2.ModelState.Name(state).removeprefix("MODEL_STATE_")  # type: ignore[arg-type]


def rows_from_proto(reply: scheduler_pb2.ListWorkersResponse) -> list[WorkerRow]:
    return [
        WorkerRow(
            worker.worker_id,
            tuple(
                SlotRow(slot.model_id, _state_name(slot.state), slot.inflight, slot.vram_mb)
                for slot in sorted(worker.models, key=lambda s: s.model_id)
            ),
        )
        for worker in sorted(reply.workers, key=lambda w: w.worker_id)
    ]


class SchedulerWorkers:
    def __init__(self, address: str | None, *, clock: Clock, timeout_s: float = 0.5, cache_s: float = 0.5):
        self._address = address
        self._clock = clock
        self._timeout_s = timeout_s
        self._cache_s = cache_s
        self._channel: grpc.aio.Channel | None = None
        self._cached: tuple[float, list[WorkerRow] | None] | None = None
        self._warned = False

    async def rows(self) -> list[WorkerRow] | None:
        if self._address is None:
            return None
        now = self._clock.monotonic()
        if self._cached is not None and now - self._cached[0] < self._cache_s:
            return self._cached[1]
        if self._channel is None:
            self._channel = aio_channel(self._address, options=retry_options())
        stub = scheduler_pb2_grpc.SchedulerServiceStub(self._channel)
        rows: list[WorkerRow] | None
        try:
            reply = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=self._timeout_s)
            rows = rows_from_proto(reply)
            self._warned = False
        except grpc.aio.AioRpcError as error:
            if not self._warned:
                self._warned = True
                log.warning(
                    "scheduler at %s unreachable for ListWorkers: %s", self._address, error.code().name
                )
            rows = None
        self._cached = (self._clock.monotonic(), rows)
        return rows

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
