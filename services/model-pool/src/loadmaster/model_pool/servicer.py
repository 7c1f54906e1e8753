"""gRPC `ModelPool` service: translation only.

`Infer` answers failures in the reply (`error_code`, `error_message`, `retryable`),
exactly as the data port does, so both paths share one shape. `Load`, `Unload` and
`Status` raise `LoadmasterError`s, which the server's interceptor maps to status codes;
a failed `Load` also leaves its error in the slot (see `Status`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import grpc

from loadmaster.common.errors import LoadmasterError
from loadmaster.common.tensors import TensorLimits
from loadmaster.model_pool.images import ImageLimits
from loadmaster.model_pool.pool import ModelPool
from loadmaster.model_pool.wire import handle_infer, signature_pb, slot_status_pb
from loadmaster.v1 import model_pool_pb2, model_pool_pb2_grpc

log = logging.getLogger(__name__)

__all__ = ["ModelPoolServiceServicer"]

_DEFAULT_LIMITS = TensorLimits()
_DEFAULT_IMAGE_LIMITS = ImageLimits()


class ModelPoolServiceServicer(model_pool_pb2_grpc.ModelPoolServiceServicer):
    def __init__(
        self,
        pool: ModelPool,
        *,
        worker_id: str,
        data_endpoint: Callable[[], str],
        limits: TensorLimits = _DEFAULT_LIMITS,
        image_limits: ImageLimits = _DEFAULT_IMAGE_LIMITS,
    ) -> None:
        self._pool = pool
        self._worker_id = worker_id
        self._data_endpoint = data_endpoint
        self._limits = limits
        self._image_limits = image_limits

    async def Infer(  # noqa: N802 - gRPC method name
        self, request: model_pool_pb2.InferRequest, context: grpc.aio.ServicerContext
    ) -> model_pool_pb2.InferResponse:
        reply, payload = await handle_infer(
            self._pool,
            request,
            request.payload,
            worker_id=self._worker_id,
            limits=self._limits,
            image_limits=self._image_limits,
        )
        reply.payload = bytes(payload)
        return reply

    async def Load(  # noqa: N802
        self, request: model_pool_pb2.LoadRequest, context: grpc.aio.ServicerContext
    ) -> model_pool_pb2.LoadResponse:
        status = await self._pool.load(request.model_id)
        if request.HasField("keep_alive_s"):
            self._pool.set_keep_alive(request.model_id, request.keep_alive_s)
            status = self._pool.status(request.model_id)
        return model_pool_pb2.LoadResponse(model=slot_status_pb(status))

    async def Unload(  # noqa: N802
        self, request: model_pool_pb2.UnloadRequest, context: grpc.aio.ServicerContext
    ) -> model_pool_pb2.UnloadResponse:
        status = await self._pool.unload(request.model_id, reason="unload requested")
        return model_pool_pb2.UnloadResponse(model=slot_status_pb(status))

    async def Status(  # noqa: N802
        self, request: model_pool_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> model_pool_pb2.StatusResponse:
        return model_pool_pb2.StatusResponse(
            worker_id=self._worker_id,
            data_endpoint=self._data_endpoint(),
            models=[slot_status_pb(status) for status in self._pool.statuses()],
            repository=self._pool.repository.names(),
            free_mb=self._pool.free_mb(),
            evictions=self._pool.counters.by_reason(),
            leased_mb_per_gpu=self._pool.leased_mb_per_gpu(),
            signatures=self._signatures(request.signatures_of),
        )

    def _signatures(self, model_ids: Sequence[str]) -> list[model_pool_pb2.ModelSignature]:
        """Declared signatures of the named models this repository holds (broken configs skipped)."""
        signatures = []
        for model_id in dict.fromkeys(model_ids):
            if not self._pool.repository.contains(model_id):
                continue
            try:
                signatures.append(signature_pb(self._pool.repository.spec(model_id)))
            except LoadmasterError as error:
                log.warning("no signature for %s: %s", model_id, error.message)
        return signatures

    async def Pin(  # noqa: N802
        self, request: model_pool_pb2.PinRequest, context: grpc.aio.ServicerContext
    ) -> model_pool_pb2.PinResponse:
        status = self._pool.pin(request.model_id, pinned=request.pinned)
        return model_pool_pb2.PinResponse(model=slot_status_pb(status))
