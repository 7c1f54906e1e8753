"""Domain values of the broker and the pure placement decisions over them.

Nothing here does I/O. `plan_placement` picks where an Acquire goes from a snapshot
of GPU states; the acquire script then re-checks the fit atomically in Redis, so a
plan made from a stale snapshot can lose a race but never overcommit a GPU.

Placement rules:
- best fit: the one GPU with the least free memory that still fits (ties: node, index);
- split (only when allowed and no single GPU fits): the node whose candidate GPUs have
  the least total free memory that still fits, spread proportionally to each GPU's free
  memory, rounding so that no GPU ever gets more than its free memory; all or nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from itertools import groupby

from loadmaster.common.errors import NotFoundError

__all__ = [
    "AcquireRequest",
    "GpuState",
    "Lease",
    "LeaseEvent",
    "LeaseEventKind",
    "Placement",
    "PlacementRequest",
    "best_fit",
    "can_ever_fit",
    "candidate_gpus",
    "describe_capacity",
    "describe_free",
    "plan_placement",
    "split_proportional",
]


@dataclass(frozen=True, slots=True)
class GpuState:
    """One GPU as the broker accounts for it. `leased_mb` is ignored when registering."""

    node: str
    index: int
    total_mb: int
    reserve_mb: int
    used_outside_mb: int = 0
    leased_mb: int = 0
    name: str = ""
    uuid: str = ""

    @property
    def capacity_mb(self) -> int:
        """What leases may use on this GPU when none are held."""
        return max(0, self.total_mb - self.reserve_mb - self.used_outside_mb)

    @property
    def free_mb(self) -> int:
        return max(0, self.capacity_mb - self.leased_mb)


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    holder: str
    node: str
    mb_per_gpu: Mapping[int, int]
    labels: Mapping[str, str]
    created_unix_ms: int
    expires_unix_ms: int
    fencing_token: int

    @property
    def total_mb(self) -> int:
        return sum(self.mb_per_gpu.values())


class LeaseEventKind(StrEnum):
    ACQUIRED = "acquired"
    RENEWED = "renewed"
    RELEASED = "released"
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class LeaseEvent:
    kind: LeaseEventKind
    lease: Lease
    timestamp_unix_ms: int


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """Where `mb` may go: `node` "" = any node; `gpus` () = any GPU of the node."""

    mb: int
    node: str = ""
    gpus: tuple[int, ...] = ()
    allow_split: bool = False


@dataclass(frozen=True, slots=True)
class AcquireRequest:
    client_request_id: str
    holder: str
    placement: PlacementRequest
    ttl_s: float = 0.0  # 0 = the broker's default
    labels: Mapping[str, str] = field(default_factory=dict)
    wait_s: float = 0.0  # > 0: wait up to this long for memory instead of failing at once
    priority: int = 0  # 0..999, higher first among waiting requests


@dataclass(frozen=True, slots=True)
class Placement:
    node: str
    mb_per_gpu: Mapping[int, int]


def candidate_gpus(gpus: Iterable[GpuState], request: PlacementRequest) -> list[GpuState]:
    """The GPUs `request` may use, sorted by (node, index).

    Raises NotFoundError when it names a node or GPU indexes that are not registered.
    """
    pool = sorted(gpus, key=lambda g: (g.node, g.index))
    if request.node:
        pool = [g for g in pool if g.node == request.node]
        if not pool:
            raise NotFoundError(f"node {request.node!r} is not registered with the broker")
    if request.gpus:
        present = {g.index for g in pool}
        missing = sorted(set(request.gpus) - present)
        if missing:
            raise NotFoundError(
                f"node {request.node!r} has no GPU {', '.join(map(str, missing))} "
                f"(it has {', '.join(map(str, sorted(present))) or 'none'})"
            )
        wanted = set(request.gpus)
        pool = [g for g in pool if g.index in wanted]
    return pool


def best_fit(gpus: Iterable[GpuState], mb: int) -> GpuState | None:
    """The GPU with the least free memory that still fits `mb`, or None."""
    fitting = [g for g in gpus if g.free_mb >= mb]
    return min(fitting, key=lambda g: (g.free_mb, g.node, g.index), default=None)


def split_proportional(free_mb: Mapping[int, int], mb: int) -> dict[int, int] | None:
    """Spread `mb` over GPUs proportionally to their free memory; None if it does not fit.

    Each GPU gets floor(mb * free / total_free); the remainder goes 1 MB at a time to the
    GPUs with the largest fractional parts. A GPU with a fractional part has
    floor(share) < share <= free, so the extra MB never overcommits it.
    """
    usable = {index: free for index, free in free_mb.items() if free > 0}
    total_free = sum(usable.values())
    if mb <= 0 or total_free < mb:
        return None
    shares = {index: mb * free // total_free for index, free in usable.items()}
    remainder = mb - sum(shares.values())
    by_fraction = sorted(usable, key=lambda index: (-(mb * usable[index] % total_free), index))
    for index in by_fraction:
        if remainder == 0:
            break
        if shares[index] < usable[index]:
            shares[index] += 1
            remainder -= 1
    if remainder:  # unreachable by the argument above; refuse rather than overcommit
        return None
    return {index: share for index, share in shares.items() if share > 0}


def plan_placement(gpus: Iterable[GpuState], request: PlacementRequest) -> Placement | None:
    """Where to put `request`, or None when it does not fit right now."""
    pool = candidate_gpus(gpus, request)
    single = best_fit(pool, request.mb)
    if single is not None:
        return Placement(node=single.node, mb_per_gpu={single.index: request.mb})
    if not request.allow_split:
        return None
    best: tuple[int, str, list[GpuState]] | None = None
    for node, group in groupby(pool, key=lambda g: g.node):
        node_gpus = list(group)
        free = sum(g.free_mb for g in node_gpus)
        if free >= request.mb and (best is None or (free, node) < best[:2]):
            best = (free, node, node_gpus)
    if best is None:
        return None
    shares = split_proportional({g.index: g.free_mb for g in best[2]}, request.mb)
    return None if shares is None else Placement(node=best[1], mb_per_gpu=shares)


def describe_free(gpus: Sequence[GpuState], *, limit: int = 32) -> str:
    """`"a/0=1024 of 15872 MB, a/1=0 of 15872 MB"`: free and capacity per GPU, for error messages."""
    if not gpus:
        return "no GPUs registered"
    parts = [f"{g.node}/{g.index}={g.free_mb} of {g.capacity_mb} MB" for g in gpus[:limit]]
    if len(gpus) > limit:
        parts.append(f"… {len(gpus) - limit} more")
    return ", ".join(parts)


def can_ever_fit(gpus: Iterable[GpuState], request: PlacementRequest) -> bool:
    """Whether `request` would fit if no lease were held and nothing used memory outside leases."""
    empty = [replace(g, leased_mb=0, used_outside_mb=0) for g in gpus]
    return plan_placement(empty, request) is not None


def describe_capacity(gpus: Sequence[GpuState], request: PlacementRequest) -> str:
    """The most `request` could get with no leases held: `"6000 MB (node a, GPU 1)"`."""
    gpus = [replace(g, leased_mb=0, used_outside_mb=0) for g in gpus]
    if not gpus:
        return "0 MB (no GPUs)"
    if request.allow_split:
        per_node: dict[str, int] = {}
        for g in gpus:
            per_node[g.node] = per_node.get(g.node, 0) + g.capacity_mb
        node, mb = max(per_node.items(), key=lambda item: (item[1], item[0]))
        return f"{mb} MB (split across node {node!r})"
    top = max(gpus, key=lambda g: (g.capacity_mb, g.node, -g.index))
    return f"{top.capacity_mb} MB (node {top.node!r}, GPU {top.index})"
