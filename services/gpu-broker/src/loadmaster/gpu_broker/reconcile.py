"""Memory used outside leases, from what NVML sees: the pure decision (`outside_lease_mb`).

NVML reports per GPU the memory used in total and per visible process. Leases carry their
holder's pid as the label `pid` (`GpuLease` and `loadmaster gpu lease` set it). For one GPU:

- a process is covered by a live lease whose `pid` is the process or one of its ancestors
  (a command run by `loadmaster gpu lease` is a child of the pid that holds the lease); what
  it uses beyond its leases' megabytes on that GPU is used outside leases;
- memory no visible process accounts for (beyond the reserve, which covers the driver's own
  contexts) may belong to live holders NVML cannot show (other PID namespaces); it is
  explained up to the megabytes of live leases with no visible process, and the rest is
  used outside leases.

A lease that expires within `horizon_ms` does not count as live here. The reaper samples more
often than that, so once a holder dies, the bytes its process still holds are recorded as
used outside leases before its lease can be reaped and its memory granted again: bytes still
in use by a live process stay unavailable. (While such a lease is still booked the same bytes
count twice, which only ever under-grants.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from loadmaster.gpu_broker.leases import Lease

__all__ = ["GpuSample", "outside_lease_mb", "outside_per_gpu"]


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU as NVML saw it: total memory used, and MB per visible process (pid -> MB)."""

    index: int
    used_mb: int
    processes: Mapping[int, int]


def _lease_pid(lease: Lease) -> int | None:
    text = lease.labels.get("pid", "")
    return int(text) if text.isdigit() else None


def outside_lease_mb(
    sample: GpuSample,
    *,
    leases: Sequence[Lease],
    node: str,
    reserve_mb: int,
    now_ms: int,
    horizon_ms: int,
    ancestors: Callable[[int], Iterable[int]],
) -> int:
    """MB of `sample`'s GPU in use outside live leases (see the module docstring)."""
    covered: dict[int, int] = {}  # holder pid -> MB of its live leases on this GPU
    anonymous_mb = 0  # live leases on this GPU whose holder pid is unknown
    for lease in leases:
        mb = lease.mb_per_gpu.get(sample.index, 0)
        if lease.node != node or mb == 0 or lease.expires_unix_ms <= now_ms + horizon_ms:
            continue
        pid = _lease_pid(lease)
        if pid is None:
            anonymous_mb += mb
        else:
            covered[pid] = covered.get(pid, 0) + mb
    remaining = dict(covered)
    outside = 0
    for pid, used in sorted(sample.processes.items()):
        holder = next((p for p in (pid, *ancestors(pid)) if p in remaining), None)
        if holder is None:
            outside += used
            continue
        take = min(used, remaining[holder])
        remaining[holder] -= take
        outside += used - take
    seen_holders = {p for p in covered if p not in remaining or remaining[p] < covered[p]}
    unseen_mb = anonymous_mb + sum(mb for p, mb in covered.items() if p not in seen_holders)
    unattributed = max(0, sample.used_mb - sum(sample.processes.values()) - reserve_mb)
    return outside + max(0, unattributed - unseen_mb)


def outside_per_gpu(
    samples: Sequence[GpuSample],
    *,
    leases: Sequence[Lease],
    node: str,
    reserve_mb: Mapping[int, int],
    now_ms: int,
    horizon_ms: int,
    ancestors: Callable[[int], Iterable[int]],
) -> dict[int, int]:
    return {
        s.index: outside_lease_mb(
            s,
            leases=leases,
            node=node,
            reserve_mb=reserve_mb.get(s.index, 0),
            now_ms=now_ms,
            horizon_ms=horizon_ms,
            ancestors=ancestors,
        )
        for s in samples
    }
