"""A byte budget per edge peer: reply bytes queued for a client and not yet taken by it.

ZMQ's send high-water mark counts messages, so a client that never reads could pin
10,000 replies of any size in the gateway. Each reply sent is recorded with a tracker
(ZMQ's `MessageTracker`: done once ZMQ has let go of the frame, i.e. the bytes went to
the kernel or the message was dropped); a peer's queued bytes are those of its replies
whose tracker is not done yet. A reply that would take a peer past its budget is not
sent (the front end drops and counts it); one reply is always admitted when nothing is
queued for the peer, so a reply larger than the budget still reaches a reading client.

Replies to one peer leave in the order they were queued, so each peer's records are a
FIFO checked from the oldest end, and a tracker that is done says the replies queued
before it are gone too. Tracking a frame costs ZMQ some microseconds, more than a small
reply's whole send, so only one reply in `track_bytes` of a peer's replies is tracked,
and it stands for the untracked ones before it: what a peer has queued is known to
within `track_bytes`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["ReplyBudget", "Tracker"]


class Tracker(Protocol):
    @property
    def done(self) -> bool: ...


@dataclass(slots=True)
class _Peer:
    queued_bytes: int = 0  # of the tracked replies and those before them
    untracked_bytes: int = 0  # queued since the last tracked reply
    replies: deque[tuple[Tracker, int]] = field(default_factory=deque)


class ReplyBudget:
    def __init__(self, max_bytes: int, *, track_bytes: int = 64 << 10) -> None:
        self._max_bytes = max_bytes
        self._track_bytes = track_bytes
        self._peers: dict[bytes, _Peer] = {}

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    def admit(self, peer: bytes, nbytes: int) -> bool:
        """Whether a reply of `nbytes` to `peer` may be queued now."""
        state = self._peers.get(peer)
        if state is None:
            return True
        self._prune(state)
        return state.queued_bytes == 0 or state.queued_bytes + nbytes <= self._max_bytes

    def should_track(self, peer: bytes, nbytes: int) -> bool:
        """Whether the next reply of `nbytes` to `peer` is sent with a tracker."""
        state = self._peers.get(peer)
        untracked = state.untracked_bytes if state is not None else 0
        return untracked + nbytes >= self._track_bytes

    def queued(self, peer: bytes, nbytes: int, tracker: Tracker | None) -> None:
        """A reply of `nbytes` to `peer` was handed to ZMQ; `tracker` (when `should_track`
        said so) says when ZMQ let go of it and of every reply to `peer` before it."""
        state = self._peers.get(peer)
        if state is None:
            state = self._peers[peer] = _Peer()
        if tracker is None:
            state.untracked_bytes += nbytes
            return
        nbytes += state.untracked_bytes
        state.untracked_bytes = 0
        if tracker.done:
            state.replies.clear()  # everything before it is gone as well
            state.queued_bytes = 0
            return
        state.replies.append((tracker, nbytes))
        state.queued_bytes += nbytes

    def queued_bytes(self, peer: bytes) -> int:
        state = self._peers.get(peer)
        if state is None:
            return 0
        self._prune(state)
        return state.queued_bytes

    @property
    def total_bytes(self) -> int:
        return sum(state.queued_bytes for state in self._peers.values())

    def sweep(self) -> None:
        """Forget what every peer has taken; peers with no tracked reply queued are dropped
        (with their untracked bytes: less than `track_bytes` each)."""
        for peer, state in list(self._peers.items()):
            self._prune(state)
            if not state.replies:
                del self._peers[peer]

    @staticmethod
    def _prune(state: _Peer) -> None:
        replies = state.replies
        while replies and replies[0][0].done:
            state.queued_bytes -= replies.popleft()[1]
