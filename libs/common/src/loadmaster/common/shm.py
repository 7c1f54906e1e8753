"""Request payloads through shared memory between a gateway and the workers on its host.

A large payload (an image) costs more to push through a second socket, gateway ->
worker, than to copy once into memory the worker can read. So the gateway owns one
region, a file under /dev/shm that it creates, maps read-write and unlinks when it
stops (`ShmArena`); it copies a payload into a slot of the region and sends the worker
a reference (region name, offset, size) instead of the bytes. The worker maps the region
read-only by name (`ShmRegions`) and decodes the tensors as views of the slot.

Safety rules, each for a reason:
- A worker opens only files named `loadmaster-gw-<pid>-<32 hex>` directly under the
  directory, without following links, and only regular files: the data port is reachable
  from the network, so a reference must not name any other file. The random part keeps a
  region's name unguessable to anyone the gateway never sent it to.
- The region is created with O_EXCL and mode 0600 (only the gateway's user maps it) and
  mapped read-only by workers. A worker that cannot map it (another host, another user)
  raises `ShmUnavailableError`, a retryable error, and the gateway sends that worker's
  payloads on the socket from then on.
- A slot is reused only once its worker is done with it: it is freed when the worker's
  reply arrives, but a slot whose request ended any other way (timeout, cancel, a second
  grant) may still be read by that worker, so it sits in quarantine for `quarantine_s`.
- A full region is never an error: `ShmArena.put` returns None and the caller sends the
  payload on the socket. The region's memory is reserved when it is created, so a full
  /dev/shm fails there (the gateway goes on without shared memory) rather than as a
  SIGBUS on a later write.
- A gateway that dies without unlinking leaves its region behind; the next gateway on the
  host removes regions of dead processes (`sweep_stale_regions`).
"""

from __future__ import annotations

import bisect
import mmap
import os
import re
import secrets
import stat
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.errors import InvalidArgumentError, UnavailableError

__all__ = [
    "REGION_PREFIX",
    "SHM_DIRECTORY",
    "ShmArena",
    "ShmRegions",
    "ShmSlot",
    "ShmUnavailableError",
    "SlotAllocator",
    "check_region_name",
    "sweep_stale_regions",
]

SHM_DIRECTORY = Path("/dev/shm")
REGION_PREFIX = "loadmaster-gw-"
_REGION_NAME = re.compile(rf"^{REGION_PREFIX}(\d{{1,10}})-[0-9a-f]{{32}}$")
_MAX_NAME_CHARS = 80
_ALIGN = 64  # slots start on cache lines, so every dtype's views are aligned


class ShmUnavailableError(UnavailableError):
    """The worker cannot map the region the request names (another host or user, or it is gone)."""


@dataclass(frozen=True, slots=True)
class ShmSlot:
    offset: int
    size: int  # payload bytes (the span it holds is rounded up to the alignment)


class SlotAllocator:
    """First-fit allocation of aligned spans of a region, with a quarantine for spans that
    a reader may still be reading. Plain values only: the arena does the I/O."""

    def __init__(self, capacity: int, *, quarantine_s: float, clock: Clock | None = None) -> None:
        self.capacity = capacity - capacity % _ALIGN
        self._quarantine_s = quarantine_s
        self._clock = clock or SystemClock()
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []  # (offset, span)
        self._spans: dict[int, int] = {}  # allocated offset -> span
        self._quarantined: deque[tuple[float, ShmSlot]] = deque()  # release times in order

    @property
    def allocated_bytes(self) -> int:
        """Bytes held by live and quarantined slots."""
        return sum(self._spans.values())

    @property
    def quarantined(self) -> int:
        return len(self._quarantined)

    def alloc(self, size: int) -> ShmSlot | None:
        """A slot for `size` bytes, or None when no free span is large enough."""
        self._release_due()
        span = max(_ALIGN, -(-size // _ALIGN) * _ALIGN)
        for index, (offset, free_span) in enumerate(self._free):
            if free_span >= span:
                if free_span == span:
                    del self._free[index]
                else:
                    self._free[index] = (offset + span, free_span - span)
                self._spans[offset] = span
                return ShmSlot(offset, size)
        return None

    def free(self, slot: ShmSlot) -> None:
        """The slot's reader is done with it: reusable now."""
        span = self._spans.pop(slot.offset, None)
        if span is None:
            raise ValueError(f"slot at offset {slot.offset} is not allocated")
        self._insert_free(slot.offset, span)

    def quarantine(self, slot: ShmSlot) -> None:
        """The slot's reader may still read it: reusable after `quarantine_s`."""
        if slot.offset not in self._spans:
            raise ValueError(f"slot at offset {slot.offset} is not allocated")
        self._quarantined.append((self._clock.monotonic() + self._quarantine_s, slot))

    def _release_due(self) -> None:
        now = self._clock.monotonic()
        while self._quarantined and self._quarantined[0][0] <= now:
            self.free(self._quarantined.popleft()[1])

    def _insert_free(self, offset: int, span: int) -> None:
        """Put a span back, merged with the free spans it touches."""
        index = bisect.bisect_left(self._free, (offset, 0))
        if index < len(self._free) and offset + span == self._free[index][0]:
            span += self._free.pop(index)[1]
        if index and (before := self._free[index - 1])[0] + before[1] == offset:
            self._free[index - 1] = (before[0], before[1] + span)
            return
        self._free.insert(index, (offset, span))


class ShmArena:
    """The gateway's region: created under `directory`, mapped read-write, carved into slots."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        quarantine_s: float,
        clock: Clock | None = None,
        directory: Path = SHM_DIRECTORY,
    ) -> None:
        self.name = f"{REGION_PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
        self.path = directory / self.name
        self._slots = SlotAllocator(capacity_bytes, quarantine_s=quarantine_s, clock=clock)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            # Reserved now, not on first write: a write to a sparse page of a full tmpfs is a
            # SIGBUS, while a region that does not fit fails here (OSError) and shm stays off.
            os.posix_fallocate(fd, 0, self._slots.capacity)
            self._map = mmap.mmap(fd, self._slots.capacity, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self._view = memoryview(self._map)

    @property
    def slots(self) -> SlotAllocator:
        return self._slots

    def put(self, payload: Any) -> ShmSlot | None:
        """Copy `payload` into a new slot; None when the region has no room for it."""
        data = memoryview(payload)
        if data.format != "B" or data.ndim != 1:
            data = data.cast("B")
        slot = self._slots.alloc(data.nbytes)
        if slot is not None:
            self._view[slot.offset : slot.offset + slot.size] = data
        return slot

    def free(self, slot: ShmSlot) -> None:
        self._slots.free(slot)

    def quarantine(self, slot: ShmSlot) -> None:
        self._slots.quarantine(slot)

    def close(self) -> None:
        """Unmap and unlink; workers' maps stay valid until they drop them."""
        self._view.release()
        self._map.close()
        self.path.unlink(missing_ok=True)


class ShmRegions:
    """The regions a worker reads payloads from: opened by name on first use (read-only),
    kept mapped for the next request; the least recently used is dropped past `max_regions`
    (a dropped map is unmapped once no tensor views it)."""

    def __init__(self, *, directory: Path = SHM_DIRECTORY, max_regions: int = 8) -> None:
        self._directory = directory
        self._max_regions = max_regions
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()

    def view(self, region: str, offset: int, size: int) -> memoryview:
        """The read-only bytes [offset, offset + size) of `region`. Raises `InvalidArgumentError`
        (naming the field) for a bad reference, `ShmUnavailableError` when it cannot be mapped."""
        check_region_name(region)
        mapped = self._maps.get(region)
        if mapped is None:
            mapped = self._open(region)
        else:
            self._maps.move_to_end(region)
        if offset + size > len(mapped):
            raise InvalidArgumentError(
                f"shm.offset/shm.size: bytes [{offset}, {offset + size}) lie outside "
                f"the {len(mapped)}-byte region {region}"
            )
        return memoryview(mapped)[offset : offset + size]

    def _open(self, region: str) -> mmap.mmap:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO would hang
        try:
            fd = os.open(self._directory / region, flags)
        except OSError as error:
            raise ShmUnavailableError(
                f"shared memory region {region} cannot be opened here: {error.strerror}"
            ) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
                raise InvalidArgumentError(f"shm.region: {region} is not a shared memory region")
            mapped = mmap.mmap(fd, info.st_size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        # A region unlinked since (its gateway stopped) is never named again: unmap it.
        for gone in [name for name in self._maps if not (self._directory / name).exists()]:
            del self._maps[gone]
        self._maps[region] = mapped
        if len(self._maps) > self._max_regions:
            self._maps.popitem(last=False)
        return mapped

    def close(self) -> None:
        self._maps.clear()


def check_region_name(region: str) -> None:
    """Raise `InvalidArgumentError` unless `region` is a name a gateway gives its region."""
    if len(region) > _MAX_NAME_CHARS or _REGION_NAME.fullmatch(region) is None:
        raise InvalidArgumentError(f"shm.region: {region[:_MAX_NAME_CHARS]!r} is not a gateway region name")


def sweep_stale_regions(directory: Path = SHM_DIRECTORY) -> list[str]:
    """Unlink regions whose gateway process is gone (it was killed); returns their names."""
    removed: list[str] = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for path in entries:
        match = _REGION_NAME.fullmatch(path.name)
        if match is None or _alive(int(match.group(1))):
            continue
        try:
            if path.lstat().st_uid != os.getuid():
                continue
            path.unlink()
        except OSError:
            continue
        removed.append(path.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
