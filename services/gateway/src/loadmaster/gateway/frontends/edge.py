"""The ZMQ edge front end (the Inferential wire protocol).

A client DEALER sends `[b"", Observation, payload]`; the ROUTER answers
`[identity, b"", ModelResponse, payload]`. Every observation gets exactly one
reply, in order per (client connection, model). Replies are sent without
blocking, so a client that stops reading never stalls replies to others, and
each peer has a byte budget (`ReplyBudget`): a client that does not take its
replies loses the ones past it (counted as `replies_dropped`) instead of pinning
the gateway's memory.

Identities are not up for grabs: a second connection that presents an identity
already connected does not take it over (no ROUTER handover), ZMTP heartbeats
disconnect a peer that went silent so a restarted client gets its identity back
within seconds, and under CURVE an identity stays bound to the public key that
first used it (a message from another key under it is dropped and logged).

The ROUTER is a plain ZMQ socket read straight from the event loop
(`SocketReader`): an observation goes from the socket through validation to
the worker's data link within one callback, with no Future, Task or extra loop
iteration per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import OrderedDict
from functools import partial
from typing import Any

import zmq
import zmq.asyncio

from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.errors import (
    InternalError,
    InvalidArgumentError,
    LoadmasterError,
    OverflowError_,
    ResourceExhaustedError,
)
from loadmaster.common.framing import (
    REQUEST_ID_KEY,
    SocketReader,
    edge_error_response,
    router_reply,
    split_router_frames,
)
from loadmaster.common.gateway_config import GatewaySettings
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.gateway.calls import CallResult
from loadmaster.gateway.curve import EdgeCurve
from loadmaster.gateway.dispatcher import Dispatcher
from loadmaster.gateway.ordering import ReplyOrderer, Ticket
from loadmaster.gateway.reply_budget import ReplyBudget
from loadmaster.gateway.validation import (
    needs_off_loop,
    observation_to_call,
    observation_to_call_off_loop,
    parse_observation,
)
from loadmaster.v1 import edge_pb2

__all__ = ["EdgeFrontend"]

log = logging.getLogger(__name__)

_SWEEP_INTERVAL_S = 1.0  # how often peers' taken replies are forgotten
_MAX_BOUND_IDENTITIES = 100_000  # CURVE identity bindings kept; the least recently used go first
_BINDING_IDLE_S = 600.0  # a binding unused this long is forgotten
_USER_ID = "User-Id"  # ZAP's user id of a CURVE peer: its public key (Z85)


class EdgeFrontend:
    def __init__(
        self,
        settings: GatewaySettings,
        dispatcher: Dispatcher,
        telemetry: TelemetryReporter,
        context: zmq.asyncio.Context,
        *,
        gateway_id: str,
        clock: Clock | None = None,
    ) -> None:
        self._settings = settings
        self._clock: Clock = clock or SystemClock()
        self._dispatcher = dispatcher
        self._telemetry = telemetry
        self._context = context
        self._ids = (f"{gateway_id}-{n}" for n in itertools.count(1))
        self._orderer: ReplyOrderer[list[Any]] = ReplyOrderer(self._send)
        self._socket: zmq.Socket[Any] | None = None
        self._reader: SocketReader | None = None
        self._curve = EdgeCurve(settings.auth.curve, context)
        self._budget = ReplyBudget(settings.edge.max_queued_reply_bytes)
        self._inflight: dict[bytes, int] = {}  # peer -> request payload bytes awaiting replies
        # identity -> (the CURVE key that first used it, when it was last used), oldest use first
        self._bound_keys: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self._sweeper: asyncio.Task[None] | None = None
        self._checking: set[asyncio.Task[None]] = set()  # observations checked off the loop
        self.endpoint = ""

    @property
    def curve(self) -> EdgeCurve:
        """The edge's CurveZMQ server keys and ZAP handler (the GR00T socket shares them)."""
        return self._curve

    async def start(self) -> None:
        socket: zmq.Socket[Any] = zmq.Socket(self._context, zmq.ROUTER)
        edge = self._settings.edge
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_HANDOVER, 0)  # a live connection keeps its identity
        socket.setsockopt(zmq.RCVHWM, edge.recv_hwm)
        socket.setsockopt(zmq.SNDHWM, edge.send_hwm)
        if edge.heartbeat_ivl_ms > 0:
            socket.setsockopt(zmq.HEARTBEAT_IVL, edge.heartbeat_ivl_ms)
            socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, edge.heartbeat_timeout_ms)
            socket.setsockopt(zmq.HEARTBEAT_TTL, edge.heartbeat_ttl_ms)
        self._curve.apply(socket)
        socket.bind(self._settings.edge.bind)
        self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._socket = socket
        self._reader = SocketReader(socket, self._handle, name="edge")
        self._reader.start()
        self._sweeper = asyncio.create_task(self._sweep(), name="edge-reply-budget")
        log.info("edge front end listening on %s%s", self.endpoint, " (CURVE)" if self._curve.enabled else "")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._reader is not None:
            self._reader.stop()
        for checking in list(self._checking):
            checking.cancel()
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
        if self._curve.enabled and not self._key_matches(identity, frames[-1]):
            return
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
        labels = {"model": model_id}
        self._telemetry.record("payload_size_bytes", len(message.payload), labels)
        if observation.timestamp_ns:
            staleness_ms = (self._clock.time() * 1e9 - observation.timestamp_ns) / 1e6
            self._telemetry.record("observation_staleness_ms", staleness_ms, labels)
        size = len(message.payload)
        if not self._take_inflight(identity, size):
            over = OverflowError_(
                f"this client has {self._inflight[identity]} request bytes awaiting replies "
                f"(limit {self._settings.edge.max_inflight_request_bytes}): wait for its replies"
            )
            self._telemetry.record("observation_errors", 1, {"code": over.edge_code})
            self._reply_error(
                ticket,
                identity,
                over,
                model_id=model_id,
                client=observation.client,
                request_id=observation.metadata.get(REQUEST_ID_KEY, "") or request_id,
            )
            return
        if needs_off_loop(observation):
            # Checking it costs more than a loop turn should: the validation threads do it while
            # this loop serves others. The ticket is taken, so replies stay in order.
            if len(self._checking) >= self._settings.edge.max_offloop_checks:
                self._give_back_inflight(identity, size)
                self._reply_error(
                    ticket,
                    identity,
                    ResourceExhaustedError(
                        f"{len(self._checking)} large observations are being checked; try again"
                    ),
                    model_id=model_id,
                    client=observation.client,
                    request_id=observation.metadata.get(REQUEST_ID_KEY, "") or request_id,
                )
                return
            checking = asyncio.get_running_loop().create_task(
                self._submit_checked_off_loop(ticket, identity, observation, message.payload, request_id)
            )
            self._checking.add(checking)
            checking.add_done_callback(self._checking.discard)
            return
        try:
            call = observation_to_call(
                observation, message.payload, request_id=request_id, limits=self._settings.limits
            )
        except Exception as error:
            self._give_back_inflight(identity, size)
            self._refuse(ticket, identity, observation, request_id, error)
            return
        self._submit(ticket, identity, observation, call, size)

    def _take_inflight(self, identity: bytes, size: int) -> bool:
        """Count `size` request bytes against the peer's in-flight budget; False: over it."""
        held = self._inflight.get(identity, 0)
        if held and held + size > self._settings.edge.max_inflight_request_bytes:
            return False
        self._inflight[identity] = held + size
        return True

    def _give_back_inflight(self, identity: bytes, size: int) -> None:
        left = self._inflight.get(identity, 0) - size
        if left > 0:
            self._inflight[identity] = left
        else:
            self._inflight.pop(identity, None)

    async def _submit_checked_off_loop(
        self,
        ticket: Ticket,
        identity: bytes,
        observation: edge_pb2.Observation,
        payload: Any,
        request_id: str,
    ) -> None:
        try:
            call = await observation_to_call_off_loop(
                observation, payload, request_id=request_id, limits=self._settings.limits
            )
        except Exception as error:
            self._give_back_inflight(identity, len(payload))
            self._refuse(ticket, identity, observation, request_id, error)
            return
        self._submit(ticket, identity, observation, call, len(payload))

    def _submit(
        self, ticket: Ticket, identity: bytes, observation: edge_pb2.Observation, call: Any, size: int
    ) -> None:
        client_request_id = observation.metadata.get(REQUEST_ID_KEY, "")
        self._dispatcher.submit(
            call, partial(self._on_result, ticket, identity, observation.client, client_request_id, size)
        )

    def _refuse(
        self,
        ticket: Ticket,
        identity: bytes,
        observation: edge_pb2.Observation,
        request_id: str,
        error: Exception,
    ) -> None:
        """Answer a request that failed its checks; anything but a `LoadmasterError` is a bug,
        logged and answered `internal` (its reply ticket must never stay open)."""
        refusal = error if isinstance(error, LoadmasterError) else None
        if refusal is None:
            log.error(
                "checking a request failed",
                exc_info=error,
                extra={"request_id": request_id, "model": observation.model_id},
            )
            refusal = InternalError(f"internal error: {type(error).__name__}")
        self._telemetry.record("observation_errors", 1, {"code": refusal.edge_code})
        self._reply_error(
            ticket,
            identity,
            refusal,
            model_id=observation.model_id,
            client=observation.client,
            request_id=observation.metadata.get(REQUEST_ID_KEY, "") or request_id,
        )

    def _on_result(
        self,
        ticket: Ticket,
        identity: bytes,
        client: edge_pb2.Client,
        client_request_id: str,
        size: int,
        result: CallResult,
    ) -> None:
        self._give_back_inflight(identity, size)
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
            timestamp_ns=int(self._clock.time() * 1e9),
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

    def _key_matches(self, identity: bytes, frame: Any) -> bool:
        """Under CURVE: whether the message's key is the one its identity is bound to (the
        first key seen under it is). A mismatch is dropped: a reply would reach the owner."""
        try:
            key = str(frame.get(_USER_ID) or "") if isinstance(frame, zmq.Frame) else ""
        except zmq.ZMQError:  # no such property
            key = ""
        if not key or identity[:1] == b"\x00":
            return True  # no ZAP user id, or an identity ZMQ made up for this one connection
        now = self._clock.monotonic()
        bound, _ = self._bound_keys.get(identity, (key, now))
        if bound == key:
            self._bound_keys[identity] = (key, now)
            self._bound_keys.move_to_end(identity)
            if len(self._bound_keys) > _MAX_BOUND_IDENTITIES:
                self._bound_keys.popitem(last=False)
            return True
        self._telemetry.record("identity_conflicts", 1)
        log.warning(
            "edge: dropped a message under identity %r from CURVE key %s; the identity belongs to key %s",
            identity,
            key,
            bound,
        )
        return False

    def _send(self, frames: list[Any]) -> None:
        assert self._socket is not None and self._reader is not None
        identity = frames[0]
        nbytes = sum(len(frame) for frame in frames[1:])
        if not self._budget.admit(identity, nbytes):  # the client is not taking its replies
            self._telemetry.record("replies_dropped", 1, {"reason": "byte_budget"})
            log.debug("reply to %r dropped: over the peer's byte budget", identity)
            return
        socket, last = self._socket, len(frames) - 1
        tail = frames[last]
        track = self._budget.should_track(identity, nbytes)
        if track:  # a frame tracks only if made to (a received one never was): wrap its bytes
            tail = zmq.Frame(tail.buffer if isinstance(tail, zmq.Frame) else tail, track=True, copy=False)
        try:
            for frame in frames[:last]:
                socket.send(frame, zmq.SNDMORE | zmq.NOBLOCK, copy=False)
            socket.send(tail, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as error:  # the client is gone or not reading: drop, never block
            self._telemetry.record("send_errors", 1)
            log.debug("reply to %r dropped: %s", identity, error)
        else:
            self._budget.queued(identity, nbytes, tail.tracker if track else None)
        self._reader.sent()

    async def _sweep(self) -> None:
        while True:
            await self._clock.sleep(_SWEEP_INTERVAL_S)
            try:
                self._budget.sweep()
                self._forget_idle_bindings()
            except Exception:
                log.exception("edge: sweeping reply budgets failed")

    def _forget_idle_bindings(self) -> None:
        """An identity unused for `_BINDING_IDLE_S` may be taken by another key (a client that
        rotated its key): while its owner is connected, ZMQ itself refuses a second connection
        under it (no handover), so only a gone owner's binding is forgotten."""
        horizon = self._clock.monotonic() - _BINDING_IDLE_S
        while self._bound_keys:
            identity, (_, used) = next(iter(self._bound_keys.items()))
            if used > horizon:
                return
            del self._bound_keys[identity]
