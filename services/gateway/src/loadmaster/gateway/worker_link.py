"""Data-plane links to model-pool workers: one ZMQ DEALER per worker data endpoint.

Requests go out as `[b"", InferRequest, payload]` with the payload frame passed
through untouched (a received frame is forwarded without copying its data);
replies come back as `[b"", InferReply, payload]` and are handed to `on_reply`
with the payload frame, again without a copy. Generation streams share the link: out
`[GENERATE_REQUEST_FRAME | GENERATE_CANCEL_FRAME, message]` (`send_generation`), back
`[GENERATE_REPLIES_FRAME, GenerateReplies]` to `on_generation_replies`.
The sockets are plain ZMQ sockets read straight from the event loop (`SocketReader`): no
Future or task wake-up per message, because on this path they cost more than the message.

A link is opened on first use and lost, once and for all, when (docs/liveness.md):
- its connection drops (the worker's process died and its kernel closed the socket), or
  ZMTP heartbeats go unanswered (`LIVENESS.zmtp_bound_s`: a frozen process, a host or
  container that vanished, a cut network: nothing closes then);
- it did not connect within `LIVENESS.connect_within_s` (name resolved, TCP and ZMTP
  handshake): a worker that was gone before the link was opened.
Then `on_lost(endpoint)` is called, so what that worker held is not left waiting, the
socket is closed (what had arrived on it is read first) and sends to the endpoint fail at
once (`UnavailableError`) for `LIVENESS.refuse_lost_s`, by when the scheduler has noticed
the worker too; a later send opens a new link.

Host names are resolved here, off the event loop, never by libzmq: libzmq resolves a
`tcp://name:port` endpoint with a blocking getaddrinfo on its I/O thread, at every
reconnect, and that thread serves every socket of the context (the edge front end's too).
A worker container that is gone leaves a name that no DNS server answers for: glibc gives
up after 2 x 5 s, and for those 10 s the gateway moved no message at all (issue 33). So a
link connects to the address its name had when the link was opened, and a link is never
reconnected: a worker that comes back (perhaps at another address) gets a new link.

A worker on this host (a loopback endpoint) is reached over its Unix socket instead when it
listens on one (loadmaster.common.local_link: ~80 us less per call, no I/O threads). That link
is lost when the kernel closes it (the worker died) or when the worker's process is seen
stopped (SIGSTOP: a Unix socket has no heartbeat answered by a native thread, so the gateway
reads the process's state every `zmtp_probe_every_s`); a worker that does not listen there is
reached over ZMQ as any other. A tensor call to a local worker with calls unanswered waits for
the end of the loop turn and leaves in one write with the turn's other calls (Nagle's rule: the
worker is at work, and one wake-up serves them all); to an idle worker it goes out at once. At 8 clients on `double` that took the suite from ~410 to ~330 us of CPU
a call, and left a lone client's latency as it was (docs/data-path.md). Generation messages
always go at once.

A large payload for a worker on this host goes through shared memory instead of the
socket (`ShmPayloads`; see loadmaster.common.shm): it is copied into a slot of the
gateway's region, created on first use, and the request names the slot (its payload
frame is empty). The dispatcher frees the slot when the worker answers, or quarantines
it when the request ended otherwise. A worker that cannot map the region gets its
payloads on the socket after `refuse`; a region that cannot be created turns shared
memory off.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import itertools
import logging
import socket as _socket
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import zmq
from google.protobuf.message import DecodeError
from zmq.utils.monitor import parse_monitor_message

from loadmaster.common import local_link, transport
from loadmaster.common.addresses import is_local
from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.errors import UnavailableError
from loadmaster.common.framing import (
    GENERATE_REPLIES_FRAME,
    SocketReader,
    receive_frames,
    send_frames,
)
from loadmaster.common.gateway_config import SharedMemorySettings
from loadmaster.common.liveness import LIVENESS, LinkLiveness
from loadmaster.common.shm import SHM_DIRECTORY, ShmArena, ShmSlot, sweep_stale_regions
from loadmaster.v1 import model_pool_pb2

__all__ = ["ShmPayloads", "WorkerLinks", "is_local_endpoint", "numeric_endpoint", "resolve_endpoint"]

log = logging.getLogger(__name__)

ReplyHandler = Callable[[model_pool_pb2.InferResponse, Any], None]
GenerationHandler = Callable[[str, model_pool_pb2.GenerateReplies], None]
_monitor_ids = itertools.count(1)
_WATCHED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
_RESOLVER_THREADS = 2  # a name that no DNS server answers holds one for the resolver's timeout


def numeric_endpoint(endpoint: str) -> bool:
    """Whether libzmq can connect `endpoint` without resolving a name: ipc://, inproc://, or
    tcp:// to an IP address (or an interface/source form, which is passed on as it is)."""
    if not endpoint.startswith("tcp://"):
        return True
    rest = endpoint[len("tcp://") :]
    if ";" in rest:
        return True
    host = rest.rpartition(":")[0].strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def resolve_endpoint(endpoint: str) -> str:
    """`tcp://name:port` -> `tcp://address:port` (blocking: call it off the loop). IPv4, as
    libzmq resolves for a socket without ZMQ_IPV6."""
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    infos = _socket.getaddrinfo(host, int(port), _socket.AF_INET, _socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"no IPv4 address for {host}")
    return f"tcp://{infos[0][4][0]}:{port}"


class _Link:
    """One worker's DEALER, its monitor, and where its connection stands; or its local link."""

    __slots__ = (
        "backlog",
        "deadline",
        "endpoint",
        "local",
        "monitor",
        "monitor_reader",
        "pid",
        "reader",
        "resolving",
        "socket",
        "unanswered",
        "up",
    )

    def __init__(
        self,
        endpoint: str,
        socket: zmq.Socket[Any] | None,
        reader: SocketReader | None,
        local: local_link.FrameSocket | None = None,
        pid: int = 0,
    ) -> None:
        self.endpoint = endpoint
        self.socket = socket
        self.reader = reader
        self.local = local  # the Unix socket to a worker on this host (then no ZMQ socket)
        self.pid = pid  # the local worker's process, watched for a stop
        self.monitor: zmq.Socket[Any] | None = None
        self.monitor_reader: SocketReader | None = None
        self.up = False  # the ZMTP handshake succeeded
        self.unanswered = 0  # tensor calls sent and not answered yet
        # Messages sent while the endpoint's name is being resolved (None: connected).
        self.backlog: list[Sequence[Any]] | None = None
        self.resolving: asyncio.Future[str] | None = None
        self.deadline: asyncio.TimerHandle | None = None  # connected by then, or lost

    def close(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        if self.resolving is not None:
            self.resolving.cancel()
        if self.local is not None:
            self.local.close()
        if self.reader is not None:
            self.reader.stop()
        if self.monitor_reader is not None:
            self.monitor_reader.stop()
        if self.socket is not None:
            self.socket.close(linger=0)  # before its monitor: the monitor's last events go nowhere
        if self.monitor is not None:
            self.monitor.close(linger=0)
        self.backlog = None


class WorkerLinks:
    def __init__(
        self,
        context: zmq.Context[Any],
        on_reply: ReplyHandler,
        *,
        on_lost: Callable[[str], None] | None = None,
        send_hwm: int = 10_000,
        liveness: LinkLiveness = LIVENESS,
        on_generation_replies: GenerationHandler | None = None,
        clock: Clock | None = None,
    ) -> None:
        self._context = context
        self._on_generation_replies = on_generation_replies
        self._on_reply = on_reply
        self._on_lost = on_lost
        self._send_hwm = send_hwm
        self._liveness = liveness
        self._clock: Clock = clock or SystemClock()
        self._links: dict[str, _Link] = {}
        self._refused_until: dict[str, float] = {}  # lost endpoint -> clock.monotonic()
        self._resolver: concurrent.futures.ThreadPoolExecutor | None = None
        self._zmq_only: set[str] = set()  # local endpoints whose worker has no local link
        self._watching: asyncio.TimerHandle | None = None  # the local workers' stop check

    @property
    def connected(self) -> list[str]:
        """The endpoints whose links are up (for logs and tests)."""
        return sorted(endpoint for endpoint, link in self._links.items() if link.up)

    def send(self, endpoint: str, envelope: bytes, payload: Any) -> None:
        """Queue one request for `endpoint`; raise `UnavailableError` when it cannot be queued.
        A local worker with calls unanswered gets it at the end of the loop turn, in one write
        with the turn's others."""
        link = self._send(endpoint, (b"", envelope, payload), batch=True)
        link.unanswered += 1

    def send_generation(self, endpoint: str, kind: bytes, envelope: bytes) -> None:
        """Queue one generation message (GenerateRequest or CancelGeneration) for `endpoint`."""
        self._send(endpoint, (kind, envelope))

    def _send(self, endpoint: str, frames: Sequence[Any], *, batch: bool = False) -> _Link:
        link = self._links.get(endpoint) or self._open(endpoint)
        local = link.local
        if local is not None:
            if local.closed:
                raise UnavailableError(f"worker data port {endpoint} closed its local link")
            frames = [frame.buffer if isinstance(frame, zmq.Frame) else frame for frame in frames]
            if batch and link.unanswered:  # the worker is at work: the turn's calls reach it in one write
                local.send_soon(frames)
            else:  # an idle worker gets it at once
                local.send(frames)
            return link
        assert link.socket is not None and link.reader is not None
        if link.backlog is not None:  # resolving its name
            if len(link.backlog) >= self._send_hwm:
                raise UnavailableError(f"worker data port {endpoint} is not accepting requests")
            link.backlog.append(frames)
            return link
        try:
            send_frames(link.socket, frames)
        except zmq.Again:
            raise UnavailableError(f"worker data port {endpoint} is not accepting requests") from None
        except zmq.ZMQError as error:
            raise UnavailableError(f"worker data port {endpoint}: {error}") from None
        finally:
            link.reader.sent()
        return link

    # ---- a link's life ----------------------------------------------------------------

    def _open(self, endpoint: str) -> _Link:
        until = self._refused_until.get(endpoint)
        if until is not None:
            left = until - self._clock.monotonic()
            if left > 0:
                raise UnavailableError(
                    f"worker data port {endpoint} was lost (refused for another {left:.1f}s)"
                )
            del self._refused_until[endpoint]
        if endpoint not in self._zmq_only and (name := local_link.reachable_locally(endpoint)):
            link = self._open_local(endpoint, name)
            if link is not None:
                return link
            self._zmq_only.add(endpoint)
        liveness = self._liveness
        socket: zmq.Socket[Any] = zmq.Socket(self._context, zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, self._send_hwm)
        socket.setsockopt(zmq.RCVHWM, 0)
        transport.apply_curve_client(socket)  # CurveZMQ when internal_auth.data_port_curve
        socket.setsockopt(zmq.HEARTBEAT_IVL, liveness.heartbeat_ivl_ms)
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, liveness.heartbeat_timeout_ms)
        reader = SocketReader(socket, partial(self._on_frames, endpoint), name=f"data link to {endpoint}")
        link = self._links[endpoint] = _Link(endpoint, socket, reader)
        self._watch(link)
        reader.start()
        loop = asyncio.get_running_loop()
        link.deadline = loop.call_later(liveness.connect_within_s, self._overdue, link)
        if numeric_endpoint(endpoint):
            socket.connect(endpoint)
        else:
            if self._resolver is None:
                self._resolver = concurrent.futures.ThreadPoolExecutor(
                    _RESOLVER_THREADS, thread_name_prefix="worker-link-resolver"
                )
            link.backlog = []
            link.resolving = loop.run_in_executor(self._resolver, resolve_endpoint, endpoint)
            link.resolving.add_done_callback(partial(self._resolved, link))
        return link

    def _open_local(self, endpoint: str, name: str) -> _Link | None:
        """The Unix-socket link to the worker at `endpoint`, or None when it has none for us
        (nothing listens, or its process is not one this gateway can watch)."""
        try:
            sock = local_link.connect(name)
        except OSError as error:
            log.warning("local link to %s failed (%s): using ZMQ", endpoint, error)
            return None
        if sock is None:
            return None
        pid = local_link.peer_pid(sock)
        if pid <= 0 or local_link.process_stopped(pid) is not False:
            sock.close()  # another pid namespace: its stop could not be seen
            return None
        link = _Link(endpoint, None, None, pid=pid)
        link.local = local_link.FrameSocket(
            sock,
            partial(self._on_frames, endpoint),
            partial(self._lose, link),
            name=f"local link to {endpoint}",
        )
        link.up = True
        self._links[endpoint] = link
        if self._watching is None:
            self._watching = asyncio.get_running_loop().call_later(
                self._liveness.zmtp_probe_every_s, self._watch_local
            )
        log.debug("data link to %s is local (worker pid %d)", endpoint, pid)
        return link

    def _watch_local(self) -> None:
        """Every `zmtp_probe_every_s`: a local worker whose process stopped is lost, as a ZMQ
        link whose heartbeats go unanswered is."""
        self._watching = None
        for link in [link for link in self._links.values() if link.local is not None]:
            stopped = local_link.process_stopped(link.pid)
            if stopped is not False:
                self._lose(link, "its process is stopped" if stopped else "its process is gone")
        if any(link.local is not None for link in self._links.values()):
            self._watching = asyncio.get_running_loop().call_later(
                self._liveness.zmtp_probe_every_s, self._watch_local
            )

    def _watch(self, link: _Link) -> None:
        assert link.socket is not None
        address = f"inproc://worker-link-monitor-{next(_monitor_ids)}"
        link.socket.monitor(address, _WATCHED)
        monitor: zmq.Socket[Any] = zmq.Socket(self._context, zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(address)
        link.monitor = monitor
        link.monitor_reader = SocketReader(
            monitor, partial(self._on_event, link), name=f"monitor of {link.endpoint}"
        )
        link.monitor_reader.start()

    def _resolved(self, link: _Link, future: asyncio.Future[str]) -> None:
        if future.cancelled() or self._links.get(link.endpoint) is not link:
            return
        assert link.socket is not None and link.reader is not None
        link.resolving = None
        error = future.exception()
        if error is not None:
            self._lose(link, f"its host name did not resolve: {error}")
            return
        address = future.result()
        link.socket.connect(address)
        backlog, link.backlog = link.backlog or [], None
        try:
            for frames in backlog:
                send_frames(link.socket, frames)
        except zmq.ZMQError as send_error:
            self._lose(link, f"sending what waited for its address failed: {send_error}")
            return
        finally:
            link.reader.sent()
        log.debug("data link to %s connects to %s", link.endpoint, address)

    def _overdue(self, link: _Link) -> None:
        link.deadline = None
        if not link.up and self._links.get(link.endpoint) is link:
            self._lose(link, f"not connected within {self._liveness.connect_within_s:.1f}s")

    def _on_event(self, link: _Link, frames: list[Any]) -> None:
        if self._links.get(link.endpoint) is not link:
            return
        event = parse_monitor_message([getattr(frame, "bytes", frame) for frame in frames])["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            link.up = True
            if link.deadline is not None:
                link.deadline.cancel()
                link.deadline = None
        elif event == zmq.EVENT_DISCONNECTED:
            self._lose(link, "disconnected, or its heartbeats went unanswered")

    def _lose(self, link: _Link, why: str) -> None:
        """The link is over: read what arrived on it, close it, refuse its endpoint for a
        while and tell `on_lost`."""
        endpoint = link.endpoint
        if self._links.get(endpoint) is not link:
            return
        del self._links[endpoint]
        now = self._clock.monotonic()
        self._refused_until = {e: t for e, t in self._refused_until.items() if t > now}
        self._refused_until[endpoint] = now + self._liveness.refuse_lost_s
        log.warning("data link to worker %s lost: %s", endpoint, why)
        self._zmq_only.discard(endpoint)  # a worker there next may have a local link
        try:
            while link.socket is not None:  # replies that came before the end still count
                self._on_frames(endpoint, receive_frames(link.socket))
        except zmq.ZMQError:
            pass  # zmq.Again: none left
        link.close()
        if self._on_lost is not None:
            self._on_lost(endpoint)

    def _on_frames(self, endpoint: str, frames: Sequence[Any]) -> None:
        """A message on either link: zmq.Frames from a ZMQ link, memoryviews from a local one."""
        try:
            if len(frames) < 2:
                raise DecodeError(f"{len(frames)} frames")
            body = memoryview(frames[1])
            if len(frames[0]) and bytes(frames[0]) == GENERATE_REPLIES_FRAME:
                replies = model_pool_pb2.GenerateReplies.FromString(body)
                if self._on_generation_replies is not None:
                    self._on_generation_replies(endpoint, replies)
                return
            reply = model_pool_pb2.InferResponse.FromString(body)
            if (link := self._links.get(endpoint)) is not None and link.unanswered:
                link.unanswered -= 1
        except DecodeError as error:
            log.error("malformed reply from worker %s: %s", endpoint, error)
            return
        self._on_reply(reply, frames[2] if len(frames) > 2 else b"")

    async def close(self) -> None:
        for link in self._links.values():
            link.close()  # closing a link is no loss
        self._links.clear()
        if self._watching is not None:
            self._watching.cancel()
            self._watching = None
        if self._resolver is not None:
            self._resolver.shutdown(wait=False, cancel_futures=True)
            self._resolver = None


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
