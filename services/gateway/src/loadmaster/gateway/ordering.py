"""In-order replies per (client, model).

Every request takes a ticket when it arrives; its reply is released only after
the replies of all earlier tickets of the same key, whatever order the workers
finish in. Keys with nothing outstanding are forgotten, so memory follows the
number of requests in flight, not the number of clients ever seen.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["ReplyOrderer", "Ticket"]

R = TypeVar("R")


@dataclass(slots=True)
class _Lane(Generic[R]):
    next_seq: int = 0  # the next ticket number to hand out
    next_release: int = 0  # the ticket whose reply goes out next
    ready: dict[int, R] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Ticket:
    key: Hashable
    seq: int


class ReplyOrderer(Generic[R]):
    def __init__(self, release: Callable[[R], None]) -> None:
        self._release = release
        self._lanes: dict[Hashable, _Lane[R]] = {}

    def take(self, key: Hashable) -> Ticket:
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane()
        ticket = Ticket(key, lane.next_seq)
        lane.next_seq += 1
        return ticket

    def complete(self, ticket: Ticket, reply: R) -> None:
        lane = self._lanes.get(ticket.key)
        if lane is None or ticket.seq < lane.next_release or ticket.seq in lane.ready:
            raise ValueError(f"ticket {ticket} completed twice")
        if ticket.seq != lane.next_release:  # an earlier reply is still outstanding
            lane.ready[ticket.seq] = reply
            return
        self._release(reply)
        lane.next_release += 1
        while lane.next_release in lane.ready:
            self._release(lane.ready.pop(lane.next_release))
            lane.next_release += 1
        if lane.next_release == lane.next_seq:
            del self._lanes[ticket.key]

    @property
    def outstanding(self) -> int:
        return sum(lane.next_seq - lane.next_release for lane in self._lanes.values())
