"""Protobuf translation shared by the worker's three front doors: the gRPC servicer,
the ZMQ data port and the scheduler session. Protobuf lives here and in those
modules only; the pool works on domain values.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from loadmaster.common.errors import InternalError, LoadmasterError
from loadmaster.common.tensors import TensorLimits, decode_tensors, encode_tensors, has_images
from loadmaster.model_pool.images import (
    DEFAULT_IMAGE_LIMITS,
    ImageDecoder,
    ImageLimits,
    decode_request,
    gpu_jpeg_decoder,
)
from loadmaster.model_pool.pool import InferResult, ModelPool
from loadmaster.model_pool.repository import ModelSpec, TensorSpec
from loadmaster.model_pool.slots import ModelState, SlotStatus
from loadmaster.v1 import model_pool_pb2, tensor_pb2

__all__ = [
    "DECODE_OFF_LOOP_BYTES",
    "STATE_TO_PB",
    "ResultEncoder",
    "decode_off_loop",
    "encode_off_loop",
    "error_reply",
    "failure_reply",
    "handle_infer",
    "result_reply",
    "signature_pb",
    "slot_status_pb",
]

log = logging.getLogger(__name__)

STATE_TO_PB: dict[ModelState, model_pool_pb2.ModelState.ValueType] = {
    ModelState.IDLE: model_pool_pb2.MODEL_STATE_IDLE,
    ModelState.LOADING: model_pool_pb2.MODEL_STATE_LOADING,
    ModelState.READY: model_pool_pb2.MODEL_STATE_READY,
    ModelState.DRAINING: model_pool_pb2.MODEL_STATE_DRAINING,
    ModelState.UNLOADING: model_pool_pb2.MODEL_STATE_UNLOADING,
}


def slot_status_pb(status: SlotStatus) -> model_pool_pb2.ModelSlotStatus:
    return model_pool_pb2.ModelSlotStatus(
        model_id=status.model_id,
        state=STATE_TO_PB[status.state],
        generation=status.generation,
        inflight=status.inflight,
        max_inflight=status.max_inflight,
        device=status.device,
        vram_mb=status.vram_mb,
        backend=status.backend,
        pinned=status.pinned,
        last_used_unix_ms=status.last_used_unix_ms,
        loaded_unix_ms=status.loaded_unix_ms,
        load_time_ms=status.load_time_ms,
        load_started_unix_ms=status.load_started_unix_ms,
        error=status.error,
        lease_id=status.lease_id,
        priority=status.priority,
        instances=status.instances,
        max_batch_size=status.max_batch_size,
        evictions=status.evictions,
        reloads=status.reloads,
        mb_per_gpu=dict(status.mb_per_gpu),
    )


def error_reply(
    error: LoadmasterError, *, request_id: str = "", model_id: str = "", worker_id: str = ""
) -> model_pool_pb2.InferResponse:
    return model_pool_pb2.InferResponse(
        request_id=request_id,
        model_id=model_id,
        error_code=error.code,  # type: ignore[arg-type]
        error_message=error.message,
        retryable=error.retryable,
        worker_id=worker_id,
    )


def failure_reply(
    error: BaseException, *, request_id: str, model_id: str, worker_id: str
) -> model_pool_pb2.InferResponse:
    """The reply for a failed request: its `LoadmasterError`, anything else as `internal` (logged)."""
    if not isinstance(error, LoadmasterError):
        log.error("request failed", exc_info=error, extra={"request_id": request_id, "model": model_id})
        error = InternalError(f"{type(error).__name__}: {error}")
    return error_reply(error, request_id=request_id, model_id=model_id, worker_id=worker_id)


def result_reply(
    result: InferResult, *, request_id: str, model_id: str, worker_id: str
) -> tuple[model_pool_pb2.InferResponse, Any]:
    """The reply envelope and output payload of a request that ran."""
    descriptors, payload = encode_tensors(result.outputs, timestamp_ns=time.time_ns())
    reply = model_pool_pb2.InferResponse(
        request_id=request_id,
        model_id=model_id,
        outputs=descriptors,
        inference_latency_ms=result.inference_ms,
        queue_ms=result.queue_ms,
        batch_size=result.batch_size,
        worker_id=worker_id,
        generation=result.generation,
    )
    return reply, payload


class ResultEncoder:
    """`result_reply` for a stream of results, where the requests of a batch share the work.

    The replies of one engine call differ only in `request_id` and `queue_ms` (same model,
    generation, batch size, latency and output descriptors: each request's slice of the
    batch's outputs has the same dtypes, shapes and offsets when their rows match), so one
    reply is kept as a template and each next one sets those two fields on it and
    serializes it, with its own payload. The next batch of the same model, size and output
    layout reuses the template too, with its own latency and output timestamps; so does
    each next request of a model that runs one request per call (batch size 1), which
    then builds no descriptors or reply message per request. Anything else (another
    layout or row count, string outputs, a non-contiguous slice) is encoded from scratch
    by `result_reply`, which makes a new template when it can be shared.
    """

    def __init__(self, worker_id: str) -> None:
        self._worker_id = worker_id
        self._template = model_pool_pb2.InferResponse()
        self._key: tuple[str, int, int, list[tuple[int, ...]]] | None = None  # the batch it serves
        self._layout: tuple[str, int, int, list[tuple[str, Any, tuple[int, ...]]]] | None = None

    def encode(self, result: InferResult, *, request_id: str, model_id: str) -> tuple[bytes, Any]:
        """(serialized reply envelope, output payload); raises when the outputs cannot be encoded."""
        outputs = result.outputs
        key = (model_id, result.generation, result.batch_id, [array.shape for array in outputs.values()])
        if key == self._key or self._adopt(result, key):
            payload = _payload(outputs)
            if payload is not None:
                template = self._template
                template.request_id = request_id
                template.queue_ms = result.queue_ms
                return template.SerializeToString(), payload
        reply, payload = result_reply(
            result, request_id=request_id, model_id=model_id, worker_id=self._worker_id
        )
        # String tensors have their own lengths and offsets: never shared.
        shareable = tensor_pb2.DTYPE_BYTES not in [t.dtype for t in reply.outputs]
        self._key = key if shareable else None
        self._layout = _layout(result, model_id) if shareable else None
        if shareable:
            self._template = reply
        return reply.SerializeToString(), payload

    def _adopt(self, result: InferResult, key: tuple[str, int, int, list[tuple[int, ...]]]) -> bool:
        """Make the template serve the batch of `result` if only its latency and time differ."""
        if self._layout is None or self._layout != _layout(result, key[0]):
            return False
        template = self._template
        template.inference_latency_ms = result.inference_ms
        stamp = time.time_ns()
        for tensor in template.outputs:
            tensor.timestamp_ns = stamp
        self._key = key
        return True


def _layout(
    result: InferResult, model_id: str
) -> tuple[str, int, int, list[tuple[str, Any, tuple[int, ...]]]]:
    """What the replies of two batches must share to share a template (besides the worker)."""
    outputs = [(name, array.dtype, array.shape) for name, array in result.outputs.items()]
    return (model_id, result.generation, result.batch_size, outputs)


def _payload(outputs: dict[str, Any]) -> Any:
    """The payload `encode_tensors` would build for these outputs, or None when it would have
    to copy or convert one (then the caller encodes them in full)."""
    parts = []
    for array in outputs.values():
        if not array.flags.c_contiguous or array.dtype.kind in "OSU":
            return None
        parts.append(array.data.cast("B") if array.nbytes else b"")
    return parts[0] if len(parts) == 1 else b"".join(parts)


# Payloads from this size on, and every BYTES tensor (checked element by element), are
# decoded off the event loop: the loop also answers other clients and reports to the scheduler.
DECODE_OFF_LOOP_BYTES = 64 << 10
_BYTES = int(tensor_pb2.DTYPE_BYTES)
_RAW = int(tensor_pb2.ENCODING_RAW)


def decode_off_loop(descriptors: Sequence[tensor_pb2.Tensor], payload: Any) -> bool:
    """Whether decoding these inputs may take long enough to hold up an event loop (BYTES
    tensors, compressed images)."""
    if len(payload) >= DECODE_OFF_LOOP_BYTES:
        return True
    for descriptor in descriptors:  # noqa: SIM110 (not any(<genexpr>): half the cost, every request)
        if descriptor.dtype == _BYTES or descriptor.encoding > _RAW:
            return True
    return False


# Outputs of strings from this many elements (or bytes) on are encoded off the event loop: each
# element is measured and copied into the reply (a 64 MiB echo of 1 KiB strings: ~100 ms).
ENCODE_OFF_LOOP_ELEMENTS = 1024


def encode_off_loop(outputs: Mapping[str, Any]) -> bool:
    """Whether encoding these outputs may take long enough to hold up an event loop."""
    for array in outputs.values():  # a loop, not any(<genexpr>): on every reply
        if array.dtype.kind in "OSU" and (
            array.size >= ENCODE_OFF_LOOP_ELEMENTS or array.nbytes >= DECODE_OFF_LOOP_BYTES
        ):
            return True
    return False


async def handle_infer(
    pool: ModelPool,
    request: model_pool_pb2.InferRequest,
    payload: Any,
    *,
    worker_id: str,
    limits: TensorLimits,
    image_limits: ImageLimits = DEFAULT_IMAGE_LIMITS,
) -> tuple[model_pool_pb2.InferResponse, Any]:
    """Answer one InferRequest: (reply envelope, output payload). Failures are replies, never raised."""
    request_id, model_id = request.request_id, request.model_id
    try:
        declared, _ = pool.image_inputs(model_id)
        if has_images(request.inputs) or declared:  # compressed images: decoded on a thread
            decoder = ImageDecoder(image_limits, gpu_jpeg=gpu_jpeg_decoder(pool.image_device(model_id)))
            inputs = await asyncio.to_thread(
                decode_request, request.inputs, payload, limits, decoder, declared=declared
            )
        elif decode_off_loop(request.inputs, payload):
            inputs = await asyncio.to_thread(decode_tensors, request.inputs, payload, limits)
        else:
            inputs = decode_tensors(request.inputs, payload, limits)
        result = await pool.infer(model_id, inputs, deadline_unix_ns=request.deadline_unix_ns)
        reply = functools.partial(
            result_reply, result, request_id=request_id, model_id=model_id, worker_id=worker_id
        )
        if encode_off_loop(result.outputs):
            return await asyncio.to_thread(reply)
        return reply()
    except Exception as error:
        return failure_reply(error, request_id=request_id, model_id=model_id, worker_id=worker_id), b""


_SPEC_DTYPES = {
    "float16": tensor_pb2.DTYPE_FLOAT16,
    "float32": tensor_pb2.DTYPE_FLOAT32,
    "float64": tensor_pb2.DTYPE_FLOAT64,
    "bfloat16": tensor_pb2.DTYPE_BFLOAT16,
    "uint8": tensor_pb2.DTYPE_UINT8,
    "int32": tensor_pb2.DTYPE_INT32,
    "int64": tensor_pb2.DTYPE_INT64,
    "bool": tensor_pb2.DTYPE_BOOL,
    "bytes": tensor_pb2.DTYPE_BYTES,
}


def signature_pb(spec: ModelSpec) -> model_pool_pb2.ModelSignature:
    """A model's declared inputs and outputs, from its config."""

    def tensor(declared: TensorSpec) -> model_pool_pb2.TensorSpec:
        return model_pool_pb2.TensorSpec(
            name=declared.name,
            dtype=_SPEC_DTYPES[declared.dtype],  # type: ignore[arg-type]
            shape=declared.shape or (),
            any_shape=declared.shape is None,
        )

    return model_pool_pb2.ModelSignature(
        model_id=spec.model_id,
        backend=spec.backend,
        inputs=[tensor(t) for t in spec.config.inputs],
        outputs=[tensor(t) for t in spec.config.outputs],
        modality_config_json=(
            json.dumps(spec.config.modality_config) if spec.config.modality_config is not None else ""
        ),
    )
