"""Shared-memory payloads: the slot allocator, the gateway's arena and the worker's reader.

Regions live in a temporary directory instead of /dev/shm (the code takes the directory),
so nothing here can leak into the machine's shared memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from loadmaster.common.clock import FakeClock
from loadmaster.common.errors import InvalidArgumentError
from loadmaster.common.shm import (
    REGION_PREFIX,
    ShmArena,
    ShmRegions,
    ShmSlot,
    ShmUnavailableError,
    SlotAllocator,
    check_region_name,
    sweep_stale_regions,
)
from loadmaster.common.tensors import decode_tensors, encode_tensors

# ---- allocator ---------------------------------------------------------------------------


def test_slots_are_aligned_and_disjoint() -> None:
    slots = SlotAllocator(4096, quarantine_s=1.0)
    a, b, c = slots.alloc(100), slots.alloc(1), slots.alloc(64)
    assert a == ShmSlot(0, 100) and b == ShmSlot(128, 1) and c == ShmSlot(192, 64)
    assert slots.allocated_bytes == 256


def test_full_region_gives_none_and_freeing_makes_room() -> None:
    slots = SlotAllocator(1024, quarantine_s=1.0)
    first = slots.alloc(512)
    second = slots.alloc(512)
    assert first is not None and second is not None
    assert slots.alloc(1) is None  # full: the caller falls back to the socket
    slots.free(first)
    assert slots.alloc(600) is None  # 512 free, not 600
    assert slots.alloc(512) == ShmSlot(0, 512)
    assert slots.alloc(2048) is None  # larger than the region: never fits


def test_freed_neighbours_merge_into_one_span() -> None:
    slots = SlotAllocator(3 * 64, quarantine_s=1.0)
    a, b, c = slots.alloc(64), slots.alloc(64), slots.alloc(64)
    assert a and b and c
    slots.free(a)
    slots.free(c)
    assert slots.alloc(128) is None  # two free spans of 64, not adjacent
    slots.free(b)  # joins both
    assert slots.alloc(192) == ShmSlot(0, 192)
    assert slots.allocated_bytes == 192


def test_double_free_is_refused() -> None:
    slots = SlotAllocator(1024, quarantine_s=1.0)
    slot = slots.alloc(10)
    assert slot is not None
    slots.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        slots.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        slots.quarantine(slot)


def test_quarantined_slot_is_reused_only_after_the_quarantine() -> None:
    clock = FakeClock()
    slots = SlotAllocator(128, quarantine_s=30.0, clock=clock)
    slot = slots.alloc(128)
    assert slot is not None
    slots.quarantine(slot)  # the worker may still read it
    assert slots.quarantined == 1
    clock.advance(29.9)
    assert slots.alloc(64) is None  # still held: no room
    clock.advance(0.2)
    assert slots.alloc(128) == ShmSlot(0, 128)
    assert slots.quarantined == 0


def test_quarantines_end_in_order() -> None:
    clock = FakeClock()
    slots = SlotAllocator(128, quarantine_s=10.0, clock=clock)
    a, b = slots.alloc(64), slots.alloc(64)
    assert a and b
    slots.quarantine(a)
    clock.advance(5)
    slots.quarantine(b)
    clock.advance(5)
    assert slots.alloc(64) == a  # a's quarantine is over, b's is not
    assert slots.alloc(64) is None
    clock.advance(5)
    assert slots.alloc(64) == b


# ---- arena and reader ----------------------------------------------------------------------


@pytest.fixture
def arena(tmp_path: Path) -> Iterator[ShmArena]:
    region = ShmArena(1 << 20, quarantine_s=1.0, directory=tmp_path)
    yield region
    region.close()


def test_arena_creates_a_private_region_and_unlinks_it(tmp_path: Path) -> None:
    arena = ShmArena(1 << 16, quarantine_s=1.0, directory=tmp_path)
    assert arena.path.parent == tmp_path and arena.name.startswith(f"{REGION_PREFIX}{os.getpid()}-")
    check_region_name(arena.name)
    assert arena.path.stat().st_size == 1 << 16
    assert arena.path.stat().st_mode & 0o777 == 0o600
    arena.close()
    assert not arena.path.exists()


def test_payload_round_trips_as_zero_copy_read_only_views(arena: ShmArena, tmp_path: Path) -> None:
    image = np.random.default_rng(1).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    descriptors, payload = encode_tensors({"img": image, "t": np.arange(3, dtype=np.float64)})
    slot = arena.put(payload)
    assert slot is not None and slot.size == len(payload)
    regions = ShmRegions(directory=tmp_path)
    view = regions.view(arena.name, slot.offset, slot.size)
    assert view.readonly
    arrays = decode_tensors(descriptors, view)
    np.testing.assert_array_equal(arrays["img"], image)
    np.testing.assert_array_equal(arrays["t"], [0.0, 1.0, 2.0])
    assert not arrays["img"].flags.writeable
    # A view, not a copy: what the gateway writes next into the slot shows through.
    arena.free(slot)
    again = arena.put(np.zeros(len(payload), np.uint8))
    assert again == slot
    assert not arrays["img"].any()


def test_frames_and_bytes_are_accepted(arena: ShmArena, tmp_path: Path) -> None:
    slot = arena.put(b"abc")
    assert slot is not None
    assert bytes(ShmRegions(directory=tmp_path).view(arena.name, slot.offset, 3)) == b"abc"


def test_full_arena_returns_none(tmp_path: Path) -> None:
    arena = ShmArena(4096, quarantine_s=1.0, directory=tmp_path)
    try:
        assert arena.put(bytes(4096)) is not None
        assert arena.put(b"x") is None
    finally:
        arena.close()


@pytest.mark.parametrize(
    "name",
    [
        "",
        "etc",
        "../passwd",
        f"{REGION_PREFIX}1-../../etc/passwd",
        f"{REGION_PREFIX}12-{'0' * 31}",  # too short
        f"{REGION_PREFIX}12-{'A' * 32}",  # upper case
        f"{REGION_PREFIX}12-{'0' * 32}/x",
        f"{REGION_PREFIX}x-{'0' * 32}",
        f"other-12-{'0' * 32}",
        f"{REGION_PREFIX}12-{'0' * 32}\n",
        "a" * 10_000,
    ],
)
def test_only_gateway_region_names_are_opened(name: str, tmp_path: Path) -> None:
    (tmp_path / "etc").write_bytes(b"secret")
    with pytest.raises(InvalidArgumentError, match=r"^shm\.region"):
        ShmRegions(directory=tmp_path).view(name, 0, 1)


def test_references_outside_the_region_are_refused(arena: ShmArena, tmp_path: Path) -> None:
    regions = ShmRegions(directory=tmp_path)
    assert len(regions.view(arena.name, (1 << 20) - 8, 8)) == 8
    for offset, size in [(1 << 20, 1), ((1 << 20) - 8, 9), (0, (1 << 20) + 1), (2**64 - 1, 2)]:
        with pytest.raises(InvalidArgumentError, match=r"shm\.offset/shm\.size.*outside"):
            regions.view(arena.name, offset, size)


def test_missing_region_is_unavailable_and_retryable(tmp_path: Path) -> None:
    name = f"{REGION_PREFIX}{os.getpid()}-{'0' * 32}"
    with pytest.raises(ShmUnavailableError, match="cannot be opened here") as caught:
        ShmRegions(directory=tmp_path).view(name, 0, 1)
    assert caught.value.retryable


def test_links_and_non_regular_files_are_refused(arena: ShmArena, tmp_path: Path) -> None:
    link = tmp_path / f"{REGION_PREFIX}1-{'a' * 32}"
    link.symlink_to(arena.path)
    with pytest.raises(ShmUnavailableError):
        ShmRegions(directory=tmp_path).view(link.name, 0, 1)
    fifo = tmp_path / f"{REGION_PREFIX}1-{'b' * 32}"
    os.mkfifo(fifo)
    with pytest.raises(InvalidArgumentError, match="not a shared memory region"):
        ShmRegions(directory=tmp_path).view(fifo.name, 0, 1)


def test_unlinked_regions_are_dropped_when_another_is_opened(tmp_path: Path) -> None:
    regions = ShmRegions(directory=tmp_path)
    first = ShmArena(4096, quarantine_s=1.0, directory=tmp_path)
    assert first.put(b"one") is not None
    assert bytes(regions.view(first.name, 0, 3)) == b"one"
    first.close()
    assert bytes(regions.view(first.name, 0, 3)) == b"one"  # still mapped: a request may use it
    second = ShmArena(4096, quarantine_s=1.0, directory=tmp_path)
    try:
        regions.view(second.name, 0, 1)
        with pytest.raises(ShmUnavailableError):
            regions.view(first.name, 0, 3)  # dropped with the opening of the second
    finally:
        second.close()


def test_sweep_removes_regions_of_dead_processes_only(arena: ShmArena, tmp_path: Path) -> None:
    dead = tmp_path / f"{REGION_PREFIX}{2**22 + 12345}-{'c' * 32}"  # above pid_max's default
    dead.write_bytes(b"x")
    unrelated = tmp_path / "something-else"
    unrelated.write_bytes(b"x")
    assert sweep_stale_regions(tmp_path) == [dead.name]
    assert arena.path.exists() and unrelated.exists() and not dead.exists()
