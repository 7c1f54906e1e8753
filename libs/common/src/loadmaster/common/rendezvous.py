"""Rendezvous (highest-random-weight) hashing: which of several workers a key prefers.

The scheduler's placement and the gateway's placement of generations use the same score, so
requests that share a prompt prefix (`affinity_key`) land on the worker whose cache holds it,
whoever places them (docs/prefix-reuse.md)."""

from __future__ import annotations

import hashlib

__all__ = ["affinity_rank"]


def affinity_rank(key: str, worker_id: str) -> int:
    """The score of `worker_id` for `key`: stable across processes and restarts (blake2b, not
    the salted `hash`); the highest wins."""
    digest = hashlib.blake2b(f"{key}\x00{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
