"""KServe v2 `inference.GRPCInferenceService` on the gateway's gRPC server: translation only.

Each RPC converts protobuf -> `KServeInput`s / names, awaits the dispatcher or
the catalog, and converts back. Errors are `LoadmasterError`s, mapped to status
codes by the server's one interceptor. The gRPC deadline and the `timeout`
parameter become the request's timeout; a cancelled call cancels its request.

Bounds: a message may be `max_payload_bytes + max_envelope_bytes` long (`receive_options`); a
message that does not parse is INVALID_ARGUMENT (`UndecodableRequestInterceptor`); each
`ModelStreamInfer` message pays one rate-limit token and a stream has at most
`max_stream_inflight` requests in flight; requests whose inputs cost time to gather and check
are built on the validation threads, off the event loop.

Where: by default a relay process serves the public address and relays every call to this
server on a unix socket (`relay_for`, `grpc_relay`), so receiving a large message never holds
the event loop that the other front ends share.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format
from grpc_health.v1 import health_pb2

from loadmaster.common.config import Settings
from loadmaster.common.errors import InvalidArgumentError, LoadmasterError, NotFoundError
from loadmaster.common.gateway_config import LimitsSettings
from loadmaster.common.grpc_server import GRPC_OPTIONS
from loadmaster.common.reflection import V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME
from loadmaster.common.streams import until_set
from loadmaster.common.tensors import serialize_bytes
from loadmaster.gateway.auth import ADMIN, INFER, Authenticator, bearer_token
from loadmaster.gateway.calls import InferenceCall
from loadmaster.gateway.catalog import ModelCatalog
from loadmaster.gateway.dispatcher import Dispatcher
from loadmaster.gateway.frontends import grpc_handoff
from loadmaster.gateway.frontends.grpc_relay import GrpcRelay, method_kinds
from loadmaster.gateway.frontends.grpc_wire import (
    LARGE_MESSAGE_BYTES,
    LargeInferRequest,
    encode_infer_response,
    split_infer_request,
)
from loadmaster.gateway.kserve_calls import (
    EXTENSIONS,
    SERVER_NAME,
    SERVER_VERSION,
    KServeInput,
    build_call,
    check_parameters,
    costly,
    dispatch,
    numpy_for,
    outputs_of,
    parse_priority,
    parse_timeout_ms,
    tensor_metadata,
)
from loadmaster.gateway.kserve_generative import GenerativeKServe, with_generative_tensors
from loadmaster.gateway.kserve_protocol import inference_pb2, inference_pb2_grpc, model_config_pb2
from loadmaster.gateway.readiness import Readiness
from loadmaster.gateway.statistics import StatisticsSource, empty_v2
from loadmaster.gateway.validation import off_loop

__all__ = [
    "KServeGrpcServicer",
    "Undecodable",
    "UndecodableRequestInterceptor",
    "receive_options",
    "relay_for",
    "request_inputs",
]

log = logging.getLogger(__name__)

_SERVICE_PREFIX = "/inference.GRPCInferenceService/"
_INFER_METHODS = frozenset({"ModelInfer", "ModelStreamInfer"})
MODEL_VERSION = "1"  # the one version each model is served at


def relay_for(settings: Settings) -> GrpcRelay:
    """The process that serves the gateway's public gRPC address (`gateway.grpc_process`): it
    relays the gateway's services, infer messages over `LARGE_MESSAGE_BYTES` through shared memory."""
    gateway = settings.gateway
    return GrpcRelay(
        gateway.listen_address,
        methods=method_kinds(
            [
                inference_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"],
                health_pb2.DESCRIPTOR.services_by_name["Health"],
            ],
            bidi=[V1ALPHA_SERVICE_NAME, V1_SERVICE_NAME],
        ),
        handoff_methods=[_SERVICE_PREFIX + method for method in sorted(_INFER_METHODS)],
        large_message_bytes=LARGE_MESSAGE_BYTES,
        options=list({**dict(GRPC_OPTIONS), **dict(receive_options(gateway.limits))}.items()),
        grace_s=gateway.shutdown_grace_s,
        log_level=settings.log_level,
        log_format=settings.log_format,
    )


def receive_options(limits: LimitsSettings) -> list[tuple[str, int]]:
    """gRPC server options: the largest message accepted is the largest request the limits allow
    (payload plus envelope-sized room for names, shapes and parameters); larger ones are refused
    RESOURCE_EXHAUSTED by gRPC before they are read."""
    return [("grpc.max_receive_message_length", limits.max_payload_bytes + limits.max_envelope_bytes)]


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What a KServe message that does not parse becomes, so the call can answer INVALID_ARGUMENT
    (gRPC answers a deserializer's exception with UNKNOWN)."""

    reason: str


class UndecodableRequestInterceptor(grpc.aio.ServerInterceptor):
    """KServe calls whose request does not parse get INVALID_ARGUMENT naming the problem.

    Streams see an `Undecodable` message and answer it in the stream. With `handoffs` (the
    server behind the gRPC relay, `grpc_relay`), an infer message may be a marker naming
    shared memory that holds the message (`grpc_handoff`)."""

    def __init__(self, *, handoffs: bool = False) -> None:
        self._handoffs = handoffs

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or handler.request_deserializer is None or not method.startswith(_SERVICE_PREFIX):
            return handler
        deserialize = handler.request_deserializer
        serialize = handler.response_serializer
        name = method.removeprefix(_SERVICE_PREFIX)
        splits = name in _INFER_METHODS
        handoffs = splits and self._handoffs

        def tolerant(data: bytes | memoryview) -> Any:
            try:
                if handoffs and grpc_handoff.is_marker(data):
                    data = grpc_handoff.take(data)  # mapped, not copied
                if splits and len(data) > LARGE_MESSAGE_BYTES:
                    large = split_infer_request(data)
                    if large is not None:
                        return large
                return deserialize(data)
            except Exception as error:
                return Undecodable(f"{name} request is not a valid message: {error}")

        def encoded(response: Any) -> bytes:
            """A large reply comes encoded already (`KServeGrpcServicer._reply`)."""
            return response if isinstance(response, bytes) else serialize(response)

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, Undecodable):
                    raise InvalidArgumentError(request.reason)
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, tolerant, encoded)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(handler.stream_stream, tolerant, encoded)
        return handler


# Typed contents: which field carries each datatype (FP16/BF16 only travel raw).
_CONTENTS_FIELD = {
    "BYTES": "bytes_contents",
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


def _parameter(parameters: Any, name: str) -> Any:
    if name not in parameters:
        return None
    parameter = parameters[name]
    choice = parameter.WhichOneof("parameter_choice")
    return getattr(parameter, choice) if choice else None


def _contents_bytes(tensor: inference_pb2.ModelInferRequest.InferInputTensor) -> bytes:
    dtype = numpy_for(tensor.name, tensor.datatype)
    field = _CONTENTS_FIELD.get(tensor.datatype)
    if field is None:
        raise InvalidArgumentError(
            f"tensor '{tensor.name}': {tensor.datatype} data must be sent in raw_input_contents"
        )
    values = getattr(tensor.contents, field)
    if tensor.datatype == "BYTES":
        return serialize_bytes(np.asarray(list(values), dtype=object))
    if dtype.kind in "iu":
        wide = np.asarray(values, dtype=np.int64)
        info = np.iinfo(dtype)
        if wide.size and (wide.min() < info.min or wide.max() > info.max):
            raise InvalidArgumentError(
                f"tensor '{tensor.name}': a value is out of range for {tensor.datatype}"
            )
        return wide.astype(dtype).tobytes()
    return np.asarray(values, dtype=dtype).tobytes()


def request_inputs(
    request: inference_pb2.ModelInferRequest, raw_contents: Sequence[bytes | memoryview] | None = None
) -> list[KServeInput]:
    """The request's inputs; `raw_contents` stand for its `raw_input_contents` when given."""
    raw = request.raw_input_contents if raw_contents is None else raw_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidArgumentError(
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs"
        )
    return [
        KServeInput(
            tensor.name,
            tensor.datatype,
            tuple(tensor.shape),
            raw[index] if raw else _contents_bytes(tensor),
        )
        for index, tensor in enumerate(request.inputs)
    ]


def _check_version(model: str, version: str) -> None:
    if version and version != MODEL_VERSION:
        raise NotFoundError(
            f"model '{model}' has no version '{version}' (models are served at version {MODEL_VERSION})"
        )


def _token(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return bearer_token(value if isinstance(value, str) else value.decode(errors="replace"))
    return None


class KServeGrpcServicer(inference_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        dispatcher: Dispatcher,
        catalog: ModelCatalog,
        statistics: StatisticsSource,
        readiness: Readiness,
        auth: Authenticator,
        limits: LimitsSettings,
        *,
        gateway_id: str,
        generative: GenerativeKServe | None = None,
        handoffs: bool = False,
    ) -> None:
        self._dispatcher = dispatcher
        self._handoffs = handoffs  # behind the relay: large replies go through shared memory
        self._generative = generative
        self._catalog = catalog
        self._statistics = statistics
        self._readiness = readiness
        self._auth = auth
        self._limits = limits
        self._ids = (f"{gateway_id}-g{n}" for n in itertools.count(1))
        self._draining = asyncio.Event()

    # -- health and metadata ---------------------------------------------------------

    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        return inference_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        return inference_pb2.ServerReadyResponse(ready=(await self._readiness.check()).ready)

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        try:
            _check_version(request.name, request.version)
            ready = (await self._catalog.model(request.name)).ready
        except NotFoundError:
            ready = False
        return inference_pb2.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        return inference_pb2.ServerMetadataResponse(
            name=SERVER_NAME, version=SERVER_VERSION, extensions=EXTENSIONS
        )

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._auth.authenticate(_token(context), INFER)
        _check_version(request.name, request.version)
        view = await self._catalog.model(request.name)
        signature = with_generative_tensors(view, await self._catalog.signature(request.name))

        def listed(specs: Any) -> list[Any]:
            return [
                inference_pb2.ModelMetadataResponse.TensorMetadata(
                    name=t.name, datatype=t.datatype, shape=t.shape
                )
                for t in tensor_metadata(specs)
            ]

        return inference_pb2.ModelMetadataResponse(
            name=view.name,
            versions=["1"],
            platform=view.backend or signature.backend,
            inputs=listed(signature.inputs),
            outputs=listed(signature.outputs),
        )

    async def ModelConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._auth.authenticate(_token(context), INFER)
        _check_version(request.name, request.version)
        view = await self._catalog.model(request.name)
        return inference_pb2.ModelConfigResponse(
            config=model_config_pb2.ModelConfig(name=view.name, platform=view.backend, backend=view.backend)
        )

    async def ModelStatistics(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._auth.authenticate(_token(context), INFER)
        if request.name:
            await self._catalog.model(request.name)  # NotFoundError for an unknown model
        stats = await self._statistics.model_statistics(request.name)
        if request.name and not stats:
            stats = [empty_v2(request.name)]
        return json_format.ParseDict({"model_stats": stats}, inference_pb2.ModelStatisticsResponse())

    # -- repository ------------------------------------------------------------------

    async def RepositoryIndex(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._auth.authenticate(_token(context), INFER)
        views = (await self._catalog.models()).values()
        Index = inference_pb2.RepositoryIndexResponse.ModelIndex  # noqa: N806
        return inference_pb2.RepositoryIndexResponse(
            models=[
                Index(name=v.name, version="1", state=v.state, reason=v.reason)
                for v in views
                if v.ready or not request.ready
            ]
        )

    async def RepositoryModelLoad(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._auth.authenticate(_token(context), ADMIN)
        await self._catalog.load(request.model_name)
        return inference_pb2.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._auth.authenticate(_token(context), ADMIN)
        await self._catalog.unload(request.model_name)
        return inference_pb2.RepositoryModelUnloadResponse()

    # -- inference -------------------------------------------------------------------

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        client = (await self._auth.authenticate(_token(context), INFER)).name
        response, raw = await self._infer(request, client=client, deadline_s=context.time_remaining())
        return await self._reply(response, raw, stream=False)

    def drain(self) -> None:
        """The gateway is stopping: every ModelStreamInfer stream reads no further message,
        answers those it holds and ends (OK), so the server's grace is not spent on idle streams."""
        self._draining.set()

    async def ModelStreamInfer(  # noqa: N802
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """Each message is one request: it pays its own rate-limit token (the key is checked
        when the stream opens, uncharged), and at most `max_stream_inflight` are running or
        waiting to be written back at once: the stream reads its next message only when a reply
        has been written, so gRPC flow control holds back a client that sends without reading,
        instead of the gateway buffering its requests or its replies."""
        token = _token(context)
        await self._auth.authenticate(token, INFER, charge=False)
        replies: asyncio.Queue[inference_pb2.ModelStreamInferResponse | bytes | None] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()
        slots = asyncio.Semaphore(self._limits.max_stream_inflight)

        async def one(request: Any) -> None:
            try:
                if isinstance(request, Undecodable):
                    raise InvalidArgumentError(request.reason)
                client = (await self._auth.authenticate(token, INFER)).name
                response, raw = await self._infer(request, client=client, deadline_s=None)
                reply = await self._reply(response, raw, stream=True)
            except LoadmasterError as error:
                reply = self._stream_error(request, error.message)
            except Exception as error:
                log.exception("a stream request failed", extra={"request_id": getattr(request, "id", "")})
                reply = self._stream_error(request, f"internal error: {type(error).__name__}")
            replies.put_nowait(reply)  # its slot is freed once the reply is written (below)

        async def read() -> None:
            try:
                async for request in until_set(self._draining, request_iterator):
                    await slots.acquire()
                    task = asyncio.create_task(one(request))
                    del request  # the task holds it for as long as it runs, and no longer
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                while tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                replies.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (reply := await replies.get()) is not None:
                yield reply
                slots.release()  # a client that stops reading holds back its own requests
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    @staticmethod
    def _stream_error(request: Any, message: str) -> inference_pb2.ModelStreamInferResponse:
        if isinstance(request, LargeInferRequest):
            request = request.message
        if isinstance(request, Undecodable):
            return inference_pb2.ModelStreamInferResponse(error_message=message)
        return inference_pb2.ModelStreamInferResponse(
            error_message=message,
            infer_response=inference_pb2.ModelInferResponse(model_name=request.model_name, id=request.id),
        )

    def _call(
        self,
        request: Any,
        raw: Sequence[bytes | memoryview] | None,
        *,
        client: str,
        deadline_s: float | None,
    ) -> InferenceCall:
        """The request as one call: costs time in proportion to its inputs."""
        if len(request.inputs) > self._limits.max_tensors:  # before its data is copied out
            raise InvalidArgumentError(
                f"{len(request.inputs)} tensors exceed the limit of {self._limits.max_tensors}"
            )
        check_parameters({k: _parameter(request.parameters, k) for k in request.parameters}, self._limits)
        return build_call(
            request_inputs(request, raw),
            model_id=request.model_name,
            request_id=next(self._ids),
            client_id=client or "grpc",
            priority=parse_priority(_parameter(request.parameters, "priority")),
            timeout_ms=parse_timeout_ms(_parameter(request.parameters, "timeout"), deadline_s=deadline_s),
            limits=self._limits,
        )

    async def _infer(
        self, request: Any, *, client: str, deadline_s: float | None
    ) -> tuple[inference_pb2.ModelInferResponse, list[memoryview]]:
        """The response, less its raw output contents, and those."""
        raw: list[memoryview] | None = None
        if isinstance(request, LargeInferRequest):  # over 1 MiB: its data stays where it arrived
            request, raw = request.message, request.raw_input_contents
        _check_version(request.model_name, request.model_version)
        # A small message (under LARGE_MESSAGE_BYTES) has little raw data: its shapes tell the cost.
        shapes = [
            (tensor.datatype, tensor.shape, 1 if request.raw_input_contents else 0)
            for tensor in request.inputs
        ]
        if raw is not None or costly(shapes):
            call = await off_loop(self._call, request, raw, client=client, deadline_s=deadline_s)
        else:
            call = self._call(request, raw, client=client, deadline_s=deadline_s)
        if self._generative is not None:  # text_input for a generative model: a generation
            result = await self._generative.answer(self._dispatcher, call)
        else:
            result = await dispatch(self._dispatcher, call)
        outputs = outputs_of(result, [output.name for output in request.outputs])
        Output = inference_pb2.ModelInferResponse.InferOutputTensor  # noqa: N806
        response = inference_pb2.ModelInferResponse(
            model_name=request.model_name,
            model_version="1",
            id=request.id,
            outputs=[Output(name=o.name, datatype=o.datatype, shape=o.shape) for o in outputs],
        )
        return response, [o.data for o in outputs]

    async def _reply(
        self, response: inference_pb2.ModelInferResponse, raw: list[memoryview], *, stream: bool
    ) -> Any:
        """The reply as a message; with large outputs, its wire bytes, put together off the loop
        (protobuf would copy the outputs three times on it, ~800 ms for 64 MiB on a busy
        2-core machine), or behind the relay a marker of the shared memory that holds them."""
        if sum(data.nbytes for data in raw) <= LARGE_MESSAGE_BYTES:
            response.raw_output_contents.extend(bytes(data) for data in raw)
            return inference_pb2.ModelStreamInferResponse(infer_response=response) if stream else response
        parts = encode_infer_response(response, raw, stream=stream)
        if self._handoffs:
            marker = await off_loop(grpc_handoff.hand_off, parts)
            if marker is not None:
                return marker
        return await off_loop(b"".join, parts)  # a join this large copies without the GIL
