"""Data-plane links to model-pool workers: one ZMQ DEALER per worker data endpoint.

Requests go out as `[b"", InferRequest, payload]` with the payload frame passed
through untouched (a received frame is forwarded without copying its data);
replies come back as `[b"", InferReply, payload]` and are handed to `on_reply`
with the payload frame, again without a copy. Generation streams share the link: out
`[GENERATE_REQUEST_FRAME | GENERATE_CANCEL_FRAME, message]` (`send_generation`), back
`[GENERATE_REPLIES_FRAME, GenerateReplies]` to `on_generation_replies`.

Each link is watched through a ZMQ socket monitor: when its connection drops (the
worker's process died, or it answered no ZMTP heartbeat within the timeout),
`on_lost(endpoint)` is called, so what that worker held is not left waiting. The sockets are plain ZMQ sockets
read straight from the event loop (`SocketReader`): no Future or task wake-up per
message, because on this path they cost more than the message.

A large payload for a worker on this host goes through shared memory instead of the
socket (`ShmPayloads`; see loadmaster.common.shm): it is copied into a slot of the
gateway's region, created on first use, and the request names the slot (its payload
frame is empty). The dispatcher frees the slot when the worker answers, or quarantines
it when the request ended otherwise. A worker that cannot map the region gets its
payloads on the socket after `refuse`; a region that cannot be created turns shared
memory off.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import zmq
from google.protobuf.message import DecodeError
from zmq.utils.monitor import parse_monitor_message

from loadmaster.common import transport
from loadmaster.common.addresses import is_local
from loadmaster.common.errors import UnavailableError
from loadmaster.common.framing import GENERATE_REPLIES_FRAME, SocketReader, send_frames
from loadmaster.common.gateway_config import SharedMemorySettings
from loadmaster.common.shm import SHM_DIRECTORY, ShmArena, ShmSlot, sweep_stale_regions
from loadmaster.v1 import model_pool_pb2

__all__ = ["ShmPayloads", "WorkerLinks", "is_local_endpoint"]

log = logging.getLogger(__name__)

ReplyHandler = Callable[[model_pool_pb2.InferResponse, Any], None]
GenerationHandler = Callable[[str, model_pool_pb2.GenerateReplies], None]
_monitor_ids = itertools.count(1)


class WorkerLinks:
    def __init__(
        self,
        context: zmq.Context[Any],
        on_reply: ReplyHandler,
        *,
        on_lost: Callable[[str], None] | None = None,
        send_hwm: int = 10_000,
        heartbeat_ivl_ms: int = 0,
        heartbeat_timeout_ms: int = 0,
        on_generation_replies: GenerationHandler | None = None,
    ) -> None:
        self._context = context
        self._on_generation_replies = on_generation_replies
        self._on_reply = on_reply
        self._on_lost = on_lost
        self._send_hwm = send_hwm
        self._heartbeat_ivl_ms = heartbeat_ivl_ms
        self._heartbeat_timeout_ms = heartbeat_timeout_ms
        self._links: dict[str, tuple[zmq.Socket[Any], SocketReader]] = {}
        self._monitors: dict[str, tuple[zmq.Socket[Any], SocketReader]] = {}

    def send(self, endpoint: str, envelope: bytes, payload: Any) -> None:
        """Queue one request for `endpoint`; raise `UnavailableError` when it cannot be queued."""
        socket, reader = self._links.get(endpoint) or self._connect(endpoint)
        try:
            send_frames(socket, (b"", envelope, payload))
        except zmq.Again:
            raise UnavailableError(f"worker data port {endpoint} is not accepting requests") from None
        except zmq.ZMQError as error:
            raise UnavailableError(f"worker data port {endpoint}: {error}") from None
        finally:
            reader.sent()

    def send_generation(self, endpoint: str, kind: bytes, envelope: bytes) -> None:
        """Queue one generation message (GenerateRequest or CancelGeneration) for `endpoint`."""
        socket, reader = self._links.get(endpoint) or self._connect(endpoint)
        try:
            send_frames(socket, (kind, envelope))
        except zmq.Again:
            raise UnavailableError(f"worker data port {endpoint} is not accepting requests") from None
        except zmq.ZMQError as error:
            raise UnavailableError(f"worker data port {endpoint}: {error}") from None
        finally:
            reader.sent()

    def _connect(self, endpoint: str) -> tuple[zmq.Socket[Any], SocketReader]:
        socket: zmq.Socket[Any] = zmq.Socket(self._context, zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, self._send_hwm)
        socket.setsockopt(zmq.RCVHWM, 0)
        transport.apply_curve_client(socket)  # CurveZMQ when internal_auth.data_port_curve
        if self._heartbeat_ivl_ms > 0:
            socket.setsockopt(zmq.HEARTBEAT_IVL, self._heartbeat_ivl_ms)
            socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._heartbeat_timeout_ms or 3 * self._heartbeat_ivl_ms)
        if self._on_lost is not None:
            self._watch(endpoint, socket)
        socket.connect(endpoint)
        reader = SocketReader(socket, partial(self._on_frames, endpoint), name=f"data link to {endpoint}")
        reader.start()
        link = self._links[endpoint] = (socket, reader)
        return link

    def _watch(self, endpoint: str, socket: zmq.Socket[Any]) -> None:
        address = f"inproc://worker-link-monitor-{next(_monitor_ids)}"
        socket.monitor(address, zmq.EVENT_DISCONNECTED)
        monitor: zmq.Socket[Any] = zmq.Socket(self._context, zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(address)
        reader = SocketReader(monitor, partial(self._on_event, endpoint), name=f"monitor of {endpoint}")
        reader.start()
        self._monitors[endpoint] = (monitor, reader)

    def _on_event(self, endpoint: str, frames: list[Any]) -> None:
        event = parse_monitor_message([getattr(frame, "bytes", frame) for frame in frames])
        if event["event"] == zmq.EVENT_DISCONNECTED and self._on_lost is not None:
            log.warning("data link to worker %s disconnected", endpoint)
            self._on_lost(endpoint)

    def _on_frames(self, endpoint: str, frames: list[zmq.Frame]) -> None:
        try:
            if len(frames) < 2:
                raise DecodeError(f"{len(frames)} frames")
            if len(frames[0]) and frames[0].bytes == GENERATE_REPLIES_FRAME:
                replies = model_pool_pb2.GenerateReplies.FromString(frames[1].bytes)
                if self._on_generation_replies is not None:
                    self._on_generation_replies(endpoint, replies)
                return
            reply = model_pool_pb2.InferResponse.FromString(frames[1].bytes)
        except DecodeError as error:
            log.error("malformed reply from worker %s: %s", endpoint, error)
            return
        self._on_reply(reply, frames[2] if len(frames) > 2 else b"")

    async def close(self) -> None:
        for _, reader in self._monitors.values():
            reader.stop()  # closing a link is no loss
        for socket, reader in self._links.values():
            reader.stop()
            socket.close(linger=0)
        self._links.clear()
        for monitor, _ in self._monitors.values():
            monitor.close(linger=0)
        self._monitors.clear()


def is_local_endpoint(endpoint: str) -> bool:
    """Whether a data endpoint is surely on this host: ipc://, or tcp:// to a loopback address.
    (A host name may resolve here or elsewhere, so it counts as remote.)"""
    return endpoint.startswith(("ipc://", "tcp://")) and is_local(endpoint)


class ShmPayloads:
    """Which payloads go to a worker through the gateway's shared memory region, and the region."""

    def __init__(self, settings: SharedMemorySettings, *, directory: Path = SHM_DIRECTORY) -> None:
        self._settings = settings if settings.enabled else None
        self._directory = directory
        self._arena: ShmArena | None = None
        self._endpoints: dict[str, bool] = {}  # data endpoint -> its payloads may go by shm

    @property
    def region(self) -> str:
        """The region's name ("" until it is created)."""
        return self._arena.name if self._arena is not None else ""

    @property
    def arena(self) -> ShmArena | None:
        return self._arena

    def reserve(self) -> None:
        """Reserve the region now (when enabled) rather than on the first large payload: making
        and populating it takes ~100 ms, which on the event loop held up every other client,
        and its memory is then part of the gateway's idle size. Called off the loop at start."""
        if self._settings is not None and self._arena is None:
            self._create(self._settings)

    def place(self, endpoint: str, payload: Any) -> ShmSlot | None:
        """Copy `payload` into a slot when it is large and `endpoint`'s worker is on this host;
        None: send it on the socket (also when the region is full)."""
        settings = self._settings
        if settings is None or len(payload) < settings.min_payload_bytes:
            return None
        usable = self._endpoints.get(endpoint)
        if usable is None:
            usable = self._endpoints[endpoint] = is_local_endpoint(endpoint)
        if not usable:
            return None
        arena = self._arena or self._create(settings)
        return arena.put(payload) if arena is not None else None

    def free(self, slot: ShmSlot) -> None:
        """The worker answered: it reads the slot no more."""
        if self._arena is not None:
            self._arena.free(slot)

    def quarantine(self, slot: ShmSlot) -> None:
        """The request ended without the worker's answer: it may still read the slot."""
        if self._arena is not None:
            self._arena.quarantine(slot)

    def refuse(self, endpoint: str, reason: str) -> None:
        """`endpoint`'s worker cannot map the region: its payloads go on the socket from now on."""
        if self._endpoints.get(endpoint) is not False:
            log.warning(
                "worker %s cannot read shared memory (%s): payloads go on the socket", endpoint, reason
            )
        self._endpoints[endpoint] = False

    def close(self) -> None:
        """Unlink the region; nothing is placed after this."""
        self._settings = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def _create(self, settings: SharedMemorySettings) -> ShmArena | None:
        for name in sweep_stale_regions(self._directory):
            log.info("removed shared memory region %s of a gateway that is gone", name)
        try:
            self._arena = ShmArena(
                settings.region_mb << 20, quarantine_s=settings.quarantine_s, directory=self._directory
            )
        except OSError as error:
            log.warning("no shared memory for payloads (%s): they go on the socket", error)
            self._settings = None
            return None
        log.info(
            "payloads of >= %d bytes to workers on this host go through %s",
            settings.min_payload_bytes,
            self._arena.path,
        )
        return self._arena
