"""Large KServe messages passed between the gRPC relay process and the gateway through shared memory.

The gRPC relay process (`grpc_relay`) receives every KServe call and relays it to the gateway
over a unix socket. A large infer message relayed as it is would be received a second time by
grpcio in the gateway, which copies it on the gateway's event loop with the GIL held (~100-300
ms for 64 MiB): the stall the process exists to avoid. A large reply sent as it is would be
copied there once more on its way out. So a message over `LARGE_MESSAGE_BYTES`, either way,
goes through a file of its own under /dev/shm, written with `pwritev` and read with `read` or
mapped (the kernel copies, without the GIL, on a thread), and the relayed message is a marker
naming the file: a zero byte, then the file's name. Protobuf never parses a message that starts
with a zero byte (field number 0 is illegal), so a marker is never mistaken for a message, and
the relay turns any client message that starts with one into a lone zero byte, which names
nothing (`neutralize`).

Safety rules, each for a reason:
- A marker is honoured only for names `loadmaster-grpc-<pid>-<32 hex>` directly under the
  directory, opened without following links, and only for regular files of this user: a
  marker must not name any other file (only the relay reaches the gateway's socket, but that
  is no reason to trust it).
- A file is created with O_EXCL and mode 0600 and written with `pwritev` (not through a map),
  so a full /dev/shm is an error there (the message is relayed inline, as without the relay)
  rather than a SIGBUS.
- The reader unlinks a file as soon as it has it (`take` keeps a map: its views stay valid for
  as long as the request needs them, and the memory goes with the last one). The relay unlinks
  a request file the gateway did not take once the call is over (`discard`); files left by a
  process that died, or by a reply whose client went away before the relay read it, are
  removed by `sweep` (a file lives milliseconds; one older than `max_age_s` is litter).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import stat
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from loadmaster.common.shm import SHM_DIRECTORY

__all__ = [
    "FILE_PREFIX",
    "MARKER",
    "discard",
    "hand_off",
    "is_marker",
    "neutralize",
    "read",
    "sweep",
    "take",
]

log = logging.getLogger(__name__)

FILE_PREFIX = "loadmaster-grpc-"
MARKER = b"\x00"  # a marker is MARKER + the file's name (ASCII)
_NAME = re.compile(rf"^{FILE_PREFIX}(\d{{1,10}})-[0-9a-f]{{32}}$")
_MAX_MARKER_BYTES = 80
_MAX_AGE_S = 60.0


def is_marker(message: bytes | memoryview) -> bool:
    """Whether `message`, as relayed, is a marker (a protobuf message never starts like one; a
    lone zero byte names nothing)."""
    return len(message) > 1 and message[:1] == MARKER


def neutralize(message: bytes) -> bytes:
    """A client's message as the relay passes it on: one starting with a zero byte (never a valid
    message) becomes a lone zero byte, so no client can name a file."""
    return MARKER if message[:1] == MARKER else message


def hand_off(parts: Sequence[bytes | memoryview], *, directory: Path = SHM_DIRECTORY) -> bytes | None:
    """Write the message made of `parts` to a new file under `directory`; its marker, or None
    when there is no room (the caller sends the message itself). The kernel copies, without the
    GIL: on a thread, this leaves the caller's event loop free."""
    size = sum(memoryview(part).nbytes for part in parts)
    name = f"{FILE_PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
    path = directory / name
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            written = os.pwritev(fd, parts, 0)  # a full tmpfs is ENOSPC here, never a SIGBUS later
        finally:
            os.close(fd)
        if written != size:
            raise OSError(errno.ENOSPC, f"{written} of {size} bytes written")
    except OSError as error:
        path.unlink(missing_ok=True)
        log.warning("no shared memory for a %d-byte message (%s): sending it inline", size, error)
        return None
    return MARKER + name.encode()


def take(marker: bytes | memoryview, *, directory: Path = SHM_DIRECTORY) -> memoryview:
    """The message the marker names, as a read-only view of its file, which is unlinked now (the
    memory goes with the last view). Raises ValueError for a marker that names no such file."""
    fd, path = _open(marker, directory)
    try:
        mapped = mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return memoryview(mapped)


def read(marker: bytes | memoryview, *, directory: Path = SHM_DIRECTORY) -> bytes:
    """The message the marker names, read into bytes (the kernel copies, without the GIL); its
    file is unlinked. Raises ValueError for a marker that names no such file."""
    fd, path = _open(marker, directory)
    try:
        size = os.fstat(fd).st_size
        message = os.read(fd, size)
        if len(message) != size:
            raise ValueError(f"the relayed message was cut short ({len(message)} of {size} bytes)")
        return message
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def discard(marker: bytes, *, directory: Path = SHM_DIRECTORY) -> None:
    """Remove the marker's file if no reader has taken it (the call ended first)."""
    (directory / marker[1:].decode()).unlink(missing_ok=True)


def sweep(directory: Path = SHM_DIRECTORY, *, max_age_s: float = _MAX_AGE_S) -> list[str]:
    """Remove this user's files of processes that are gone, or older than `max_age_s`; returns
    their names."""
    removed: list[str] = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    horizon = time.time() - max_age_s
    for path in entries:
        match = _NAME.fullmatch(path.name)
        if match is None:
            continue
        try:
            info = path.lstat()
            if info.st_uid != os.getuid():
                continue
            if psutil.pid_exists(int(match.group(1))) and info.st_mtime > horizon:
                continue
            path.unlink()
        except OSError:
            continue
        removed.append(path.name)
    return removed


def _open(marker: bytes | memoryview, directory: Path) -> tuple[int, Path]:
    name = bytes(marker[1:_MAX_MARKER_BYTES]).decode("ascii", errors="replace")
    if len(marker) >= _MAX_MARKER_BYTES or _NAME.fullmatch(name) is None:
        raise ValueError("a message may not start with a zero byte")
    path = directory / name
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO would hang
    try:
        fd = os.open(path, flags)
    except OSError as error:
        raise ValueError(f"the relayed message is gone ({error.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size == 0:
        os.close(fd)
        raise ValueError("the relayed message is not a file of this gateway")
    return fd, path
