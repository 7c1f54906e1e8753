"""Same-host data links: a Unix stream socket beside a worker's ZMQ data port.

A gateway and a worker on one host talk over ZMQ like any other pair, and a ZMQ message
wakes three threads on its way: the sender's I/O thread, the receiver's I/O thread, then the
receiver's event loop. On a Unix socket the receiving loop is woken by the kernel directly.
Measured on the 2-core test machine (`bench/hop_timing/transports.py`): a gateway-worker round
trip takes 185-190 us over ZMQ on TCP and 107-109 us over a Unix socket read by the loop
itself, so every tensor call to a worker on the same host saves about 80 us of latency and
the I/O threads' CPU (docs/data-path.md).

**Where.** A worker whose data port is bound to TCP port P also listens on the abstract Unix
socket `loadmaster-data-P`. Abstract names belong to a network namespace, as loopback ports
do, so a gateway that reaches the worker at `tcp://127.0.0.1:P` finds that socket under that
name, and only then; it uses the ZMQ link when the worker does not listen (turned off with
`model_pool.local_link: false`, or CurveZMQ on: a Unix socket has no CURVE handshake), and for
every endpoint that is not a loopback address. Linux only (abstract names); elsewhere ZMQ.

**Wire.** The frames of one ZMQ message, framed on the stream: a header (u32 length of all
frames, u16 frame count, then u32 per frame, little endian), then the frames back to back. The
frames are what the ZMQ link carries, so both ends handle one message the same way whichever
link brought it.

**Liveness.** A process that dies has its socket closed by the kernel: the link ends at once.
A process that is frozen (SIGSTOP, a debugger) keeps its socket; ZMQ's heartbeats, answered by
native threads, find that on a ZMQ link. Here nothing would, so the gateway looks at the peer
process itself (its pid from SO_PEERCRED, its state in /proc) every `zmtp_probe_every_s`: a
stopped process ends the link as an unanswered heartbeat does. A peer whose pid this process
cannot see (another pid namespace) gets a ZMQ link instead.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import socket
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any

from loadmaster.common.addresses import host_of, is_loopback

__all__ = [
    "FrameSocket",
    "LocalListener",
    "connect",
    "listen",
    "local_name",
    "peer_pid",
    "process_stopped",
    "reachable_locally",
]

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<IH")  # length of all frames, frame count
_RECEIVE_BYTES = 256 << 10
# A message at least this big is received straight into a buffer of its own size (one copy).
_BIG_MESSAGE = 64 << 10
# The send buffer asked for (the kernel caps it at net.core.wmem_max): a camera frame's reply
# then goes in one call, not in 200 KiB steps that each wait for the reader's loop.
_SEND_BUFFER = 8 << 20
_MAX_PARTS = 512  # buffers per sendmsg (Linux's IOV_MAX is 1024)
# A peer that reads nothing while this much waits to be written to it is not a peer any more.
_MAX_UNSENT_BYTES = 256 << 20
_GONE = (errno.ECONNREFUSED, errno.ENOENT, errno.EAGAIN, errno.ECONNRESET, errno.EPIPE)


def local_name(endpoint: str) -> str | None:
    """The abstract socket name of the worker whose data port is bound at TCP `endpoint` (any
    host: the port names it); None for ipc://, a wildcard port, or not Linux."""
    if sys.platform != "linux" or not endpoint.startswith("tcp://"):
        return None
    port = endpoint.rpartition(":")[2]
    if not port.isdigit() or int(port) == 0:
        return None
    return f"\0loadmaster-data-{int(port)}"


def reachable_locally(endpoint: str) -> str | None:
    """`local_name` for an endpoint a gateway was given: only a numeric loopback address, since
    a name or another address may be another host's port of the same number."""
    host = host_of(endpoint) if endpoint.startswith("tcp://") else None
    if host is None or not is_loopback(host):
        return None
    return local_name(endpoint)


def listen(name: str) -> socket.socket:
    """A non-blocking listening socket on the abstract `name` (OSError: taken, or not Linux)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(name)
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def connect(name: str) -> socket.socket | None:
    """A connected, non-blocking socket to `name`; None when nothing listens there (a Unix
    connect completes at once or fails at once)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        sock.connect(name)
    except OSError as error:
        sock.close()
        if error.errno in _GONE:
            return None
        raise
    return sock


def peer_pid(sock: socket.socket) -> int:
    """The connected peer's pid as this process sees it (0: in a pid namespace it cannot see)."""
    pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid


def process_stopped(pid: int) -> bool | None:
    """Whether process `pid` is stopped (SIGSTOP, traced); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read()
    except OSError:
        return None
    state = fields[fields.rfind(b")") + 2 : fields.rfind(b")") + 3]  # after "pid (comm) "
    return state in (b"T", b"t")


def _header(frames: Sequence[Any]) -> bytes:
    sizes = [memoryview(frame).nbytes for frame in frames]
    return _HEAD.pack(sum(sizes), len(sizes)) + struct.pack(f"<{len(sizes)}I", *sizes)


class FrameSocket:
    """One end of a local link: messages (lists of frames) in and out of a non-blocking Unix
    stream socket, from the event loop, with no Future or Task per message.

    `on_message(frames)` gets each message as memoryviews into the received bytes (valid as
    long as they are referenced); `on_closed(reason)` is called once when the link ends under
    it (the peer closed it, or an error), not after `close`."""

    def __init__(
        self,
        sock: socket.socket,
        on_message: Callable[[list[memoryview]], None],
        on_closed: Callable[[str], None],
        *,
        name: str,
    ) -> None:
        self._sock = sock
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self._on_message = on_message
        self._on_closed = on_closed
        self._name = name
        self._partial = bytearray()  # the start of a small message not wholly received yet
        self._needed = 0  # bytes the partial message needs before it can be parsed
        self._big: bytearray | None = None  # a big message being received, sized to fit it
        self._filled = 0  # bytes of it received
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
        except OSError:
            pass  # the default buffer: big messages take more steps
        self._unsent: list[memoryview] = []  # bytes the socket did not take yet
        self._unsent_bytes = 0
        self._corked: list[Any] = []  # messages queued by `queue` until `flush`
        self.closed = False
        self._reading = True
        self._loop.add_reader(self._fd, self._readable)

    # ---- out ---------------------------------------------------------------------

    def send(self, frames: Sequence[Any]) -> None:
        """Send one message now (what the socket does not take waits, in order)."""
        self._write([_header(frames), *frames])

    def send_soon(self, frames: Sequence[Any]) -> None:
        """Send one message at the end of this loop turn, in one write with the turn's others
        (each write also wakes the peer's loop). A write that finds the link gone ends it, and
        `on_closed` tells the owner, as for a message already sent."""
        if not self._corked:
            self._loop.call_soon(self.flush)
        self.queue(frames)

    def queue(self, frames: Sequence[Any]) -> None:
        """Hold one message until `flush`: the messages of one loop turn leave in one call."""
        self._corked.append(_header(frames))
        self._corked.extend(frames)

    def flush(self) -> None:
        if self._corked:
            parts, self._corked = self._corked, []
            self._write(parts)

    def _write(self, parts: list[Any]) -> None:
        if self.closed:
            return
        if self._unsent:
            self._keep(parts, 0)
            return
        for start in range(0, len(parts), _MAX_PARTS):  # sendmsg takes at most IOV_MAX buffers
            chunk = parts[start : start + _MAX_PARTS]
            try:
                sent = self._sock.sendmsg(chunk)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as error:
                self._end(f"send failed: {error}")
                return
            if sent < sum(memoryview(part).nbytes for part in chunk):
                self._keep(parts[start:], sent)
                self._loop.add_writer(self._fd, self._writable)
                return

    def _keep(self, parts: list[Any], sent: int) -> None:
        for part in parts:
            view = memoryview(part).cast("B")
            if sent >= view.nbytes:
                sent -= view.nbytes
                continue
            self._unsent.append(view[sent:])
            self._unsent_bytes += view.nbytes - sent
            sent = 0
        if self._unsent_bytes > _MAX_UNSENT_BYTES:
            self._end(f"the peer read nothing while {self._unsent_bytes} bytes waited for it")

    def _writable(self) -> None:
        try:
            sent = self._sock.sendmsg(self._unsent[:_MAX_PARTS])
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            self._end(f"send failed: {error}")
            return
        self._unsent_bytes -= sent
        while sent:
            head = self._unsent[0]
            if sent >= head.nbytes:
                sent -= head.nbytes
                self._unsent.pop(0)
            else:
                self._unsent[0] = head[sent:]
                sent = 0
        if not self._unsent:
            self._loop.remove_writer(self._fd)

    # ---- in ----------------------------------------------------------------------

    def _readable(self) -> None:
        big = self._big  # a big message is received into its own buffer, the rest by chunks
        try:
            got: Any = (
                self._sock.recv_into(memoryview(big)[self._filled :])
                if big is not None
                else self._sock.recv(_RECEIVE_BYTES)
            )
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            self._end(f"receive failed: {error}")
            return
        if not got:
            self._end("the peer closed it")
            return
        if big is not None:
            self._filled += got
            if self._filled == len(big):
                self._big = None
                self._parse(big)  # exactly one message: its frames are views of `big`
            return
        if self._partial:
            self._partial += got
            if len(self._partial) < self._needed:
                return
            got, self._partial = bytes(self._partial), bytearray()
        self._parse(got)

    def _parse(self, data: bytes | bytearray) -> None:
        view = memoryview(data)
        at, end = 0, len(data)
        head_size = _HEAD.size
        while end - at >= head_size:
            body, count = _HEAD.unpack_from(view, at)
            start = at + head_size + 4 * count
            if end < start + body:
                self._needed = start + body - at
                if self._needed >= _BIG_MESSAGE:
                    self._big = bytearray(self._needed)
                    self._big[: end - at] = view[at:end]
                    self._filled = end - at
                    return
                break
            frames = []
            for size in struct.unpack_from(f"<{count}I", view, at + head_size):
                frames.append(view[start : start + size])
                start += size
            at = start
            try:
                self._on_message(frames)
            except Exception:
                log.exception("%s: handling a message failed", self._name)
            if self.closed:
                return
        else:
            self._needed = head_size
        if at < end:
            self._partial = bytearray(view[at:])

    # ---- the end -----------------------------------------------------------------

    def stop_reading(self) -> None:
        """Take no more messages; what is sent still goes out."""
        if not self.closed and self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def close(self) -> None:
        """End the link from this side (`on_closed` is not called)."""
        self._stop()

    def _end(self, reason: str) -> None:
        """The link ended under us: `on_closed` runs after the current callback, so a send that
        finds the link gone never calls back into its caller."""
        if not self.closed:
            self._stop()
            self._loop.call_soon(self._on_closed, reason)

    def _stop(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self._loop.is_closed():
            if self._reading:
                self._loop.remove_reader(self._fd)
            if self._unsent:
                self._loop.remove_writer(self._fd)
        self._unsent.clear()
        self._corked.clear()
        self._sock.close()


class LocalListener:
    """The worker's end: accepts local links on the abstract `name` and keeps each by the
    identity its messages are handed on with (`local-N`, never a ZMQ identity's shape, so one
    table of replies can hold both). `on_message(identity, frames)` as FrameSocket's."""

    def __init__(self, name: str, on_message: Callable[[bytes, list[memoryview]], None]) -> None:
        self._sock = listen(name)  # OSError: taken, or not Linux
        self._loop = asyncio.get_running_loop()
        self._on_message = on_message
        self._ids = 0
        self.peers: dict[bytes, FrameSocket] = {}
        self._loop.add_reader(self._sock.fileno(), self._accept)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                log.warning("accepting a local link failed: %s", error)
                return
            conn.setblocking(False)
            self._ids += 1
            identity = b"local-%d" % self._ids
            self.peers[identity] = FrameSocket(
                conn,
                functools.partial(self._on_message, identity),
                functools.partial(self._closed, identity),
                name=f"local link {identity.decode()}",
            )

    def _closed(self, identity: bytes, reason: str) -> None:
        self.peers.pop(identity, None)
        log.info("local link %s ended: %s", identity.decode(), reason)

    def stop_reading(self) -> None:
        """Accept no link and take no message any more; replies still go out."""
        if self._sock.fileno() >= 0 and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        for peer in self.peers.values():
            peer.stop_reading()

    def close(self) -> None:
        """Stop accepting and close every link."""
        self.stop_reading()
        self._sock.close()
        for peer in self.peers.values():
            peer.close()
        self.peers.clear()
