"""The ZMQ edge front end (the Inferential wire protocol).

A client DEALER sends `[b"", Observation, payload]`; the ROUTER answers
`[identity, b"", ModelResponse, payload]`. Every observation gets exactly one
reply, in order per (client connection, model). Replies are sent without
blocking, so a client that stops reading never stalls replies to others.

The ROUTER is a plain ZMQ socket read straight from the event loop
(`SocketReader`): an observation goes from the socket through validation to
the worker's data link within one callback, with no Future, Task or extra loop
iteration per message.
"""

from __future__ import annotations

import itertools
import logging
import time
from functools import partial
from typing import Any

import zmq
import zmq.asyncio

from loadmaster.common.config import GatewaySettings
from loadmaster.common.errors import InvalidArgumentError, LoadmasterError
from loadmaster.common.framing import (
    REQUEST_ID_KEY,
    SocketReader,
    edge_error_response,
    router_reply,
    send_frames,
    split_router_frames,
)
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.gateway.calls import CallResult
from loadmaster.gateway.curve import EdgeCurve
from loadmaster.gateway.dispatcher import Dispatcher
from loadmaster.gateway.ordering import ReplyOrderer, Ticket
from loadmaster.gateway.validation import observation_to_call, parse_observation
from loadmaster.v1 import edge_pb2

__all__ = ["EdgeFrontend"]

log = logging.getLogger(__name__)


class EdgeFrontend:
    def __init__(
        self,
        settings: GatewaySettings,
        dispatcher: Dispatcher,
        telemetry: TelemetryReporter,
        context: zmq.asyncio.Context,
        *,
        gateway_id: str,
    ) -> None:
        self._settings = settings
        self._dispatcher = dispatcher
        self._telemetry = telemetry
        self._context = context
        self._ids = (f"{gateway_id}-{n}" for n in itertools.count(1))
        self._orderer: ReplyOrderer[list[Any]] = ReplyOrderer(self._send)
        self._socket: zmq.Socket[Any] | None = None
        self._reader: SocketReader | None = None
        self._curve = EdgeCurve(settings.auth.curve, context)
        self.endpoint = ""

    async def start(self) -> None:
        socket: zmq.Socket[Any] = zmq.Socket(self._context, zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        socket.setsockopt(zmq.RCVHWM, self._settings.edge.recv_hwm)
        socket.setsockopt(zmq.SNDHWM, self._settings.edge.send_hwm)
        self._curve.apply(socket)
        socket.bind(self._settings.edge.bind)
        self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._socket = socket
        self._reader = SocketReader(socket, self._handle, name="edge")
        self._reader.start()
        log.info("edge front end listening on %s%s", self.endpoint, " (CURVE)" if self._curve.enabled else "")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.stop()
        if self._socket is not None:
            self._socket.close(linger=0)
        self._curve.stop()

    def _handle(self, frames: list[Any]) -> None:
        try:
            message = split_router_frames(frames)
        except InvalidArgumentError as error:
            self._telemetry.record("observation_errors", 1, {"code": error.edge_code})
            if frames and len(frames[0]) > 0:
                identity = frames[0].bytes
                ticket = self._orderer.take((identity, ""))
                self._reply_error(ticket, identity, error, model_id="", client=None, request_id="")
            return
        identity = message.identity
        request_id = next(self._ids)
        try:
            observation = parse_observation(message.envelope.bytes, self._settings.limits)
        except InvalidArgumentError as error:
            self._telemetry.record("observation_errors", 1, {"code": error.edge_code})
            ticket = self._orderer.take((identity, ""))
            self._reply_error(ticket, identity, error, model_id="", client=None, request_id=request_id)
            return
        model_id = observation.model_id
        ticket = self._orderer.take((identity, model_id))
        client_request_id = observation.metadata.get(REQUEST_ID_KEY, "")
        labels = {"model": model_id}
        self._telemetry.record("payload_size_bytes", len(message.payload), labels)
        if observation.timestamp_ns:
            staleness_ms = (time.time_ns() - observation.timestamp_ns) / 1e6
            self._telemetry.record("observation_staleness_ms", staleness_ms, labels)
        try:
            call = observation_to_call(
                observation, message.payload, request_id=request_id, limits=self._settings.limits
            )
        except InvalidArgumentError as error:
            self._telemetry.record("observation_errors", 1, {"code": error.edge_code})
            self._reply_error(
                ticket,
                identity,
                error,
                model_id=model_id,
                client=observation.client,
                request_id=client_request_id or request_id,
            )
            return
        self._dispatcher.submit(
            call, partial(self._on_result, ticket, identity, observation.client, client_request_id)
        )

    def _on_result(
        self,
        ticket: Ticket,
        identity: bytes,
        client: edge_pb2.Client,
        client_request_id: str,
        result: CallResult,
    ) -> None:
        response_id = client_request_id or result.request_id
        if result.error is not None:
            self._reply_error(
                ticket,
                identity,
                result.error,
                model_id=result.model_id,
                client=client,
                request_id=response_id,
            )
            return
        response = edge_pb2.ModelResponse(
            client=client,
            response_id=response_id,
            timestamp_ns=time.time_ns(),
            tensors=result.outputs,
            inference_latency_ms=result.inference_latency_ms,
            model_id=result.model_id,
        )
        if client_request_id:
            response.metadata[REQUEST_ID_KEY] = client_request_id
        self._orderer.complete(ticket, router_reply(identity, response.SerializeToString(), result.payload))

    def _reply_error(
        self,
        ticket: Ticket,
        identity: bytes,
        error: LoadmasterError,
        *,
        model_id: str,
        client: edge_pb2.Client | None,
        request_id: str,
    ) -> None:
        response = edge_error_response(error, model_id=model_id, client=client, request_id=request_id)
        self._orderer.complete(ticket, router_reply(identity, response.SerializeToString()))

    def _send(self, frames: list[Any]) -> None:
        assert self._socket is not None and self._reader is not None
        try:
            send_frames(self._socket, frames)
        except zmq.ZMQError as error:  # the client is gone or not reading: drop, never block
            self._telemetry.record("send_errors", 1)
            log.debug("reply to %r dropped: %s", frames[0], error)
        self._reader.sent()
