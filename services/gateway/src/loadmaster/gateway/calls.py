"""What a request is inside the gateway, whichever front end it came from."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from loadmaster.common import tracing
from loadmaster.common.errors import LoadmasterError
from loadmaster.v1 import scheduler_pb2, tensor_pb2

__all__ = ["CallResult", "InferenceCall", "ResultCallback", "request_info"]


@dataclass(slots=True)
class InferenceCall:
    """One inference request: metadata for the scheduler, descriptors + payload for the worker."""

    request_id: str
    client_id: str
    model_id: str
    inputs: Sequence[tensor_pb2.Tensor]
    payload: Any  # zmq.Frame, bytes or memoryview; forwarded to the worker without copying
    client_type: str = ""
    # The front end holds a connection for the call and cancels it when that goes (KServe
    # HTTP and gRPC, the image API): the scheduler never drops it for a silent client.
    connection_bound: bool = False
    priority: int = 1
    urgency: float = 0.0
    steps_remaining: int | None = None
    timeout_ms: float = 0.0
    metadata: dict[str, str] = field(default_factory=dict)
    received_unix_ns: int = 0
    received_monotonic: float = 0.0


@dataclass(frozen=True, slots=True)
class CallResult:
    """The one outcome of a call: outputs, or an error."""

    request_id: str
    model_id: str
    outputs: Sequence[tensor_pb2.Tensor] = ()
    payload: Any = b""
    inference_latency_ms: float = 0.0
    worker_id: str = ""
    error: LoadmasterError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


ResultCallback = Callable[[CallResult], None]


def request_info(call: InferenceCall, credit_id: str, span: trace.Span) -> scheduler_pb2.RequestInfo:
    """What the scheduler is told of a call (never its payload), with its trace context."""
    info = scheduler_pb2.RequestInfo(
        request_id=call.request_id,
        client_id=call.client_id,
        model_id=call.model_id,
        priority=call.priority,
        urgency=call.urgency,
        steps_remaining=call.steps_remaining,
        received_unix_ns=call.received_unix_ns,
        timeout_ms=call.timeout_ms,
        payload_bytes=len(call.payload),
        client_type=call.client_type,
        connection_bound=call.connection_bound,
        credit_id=credit_id,
    )
    if span.is_recording():
        tracing.inject(info.trace_context, span=span)
    return info
